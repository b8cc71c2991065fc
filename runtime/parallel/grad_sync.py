"""Gradient and buffer synchronization across the stages and replicas of one step: the process
groups every rank creates (``create_groups``), tie gradients summed over their copies and every
gradient averaged over the data-parallel replicas (``sync_gradients``, one flat all-reduce per dtype
bucket: ``allreduce_flat_``, the bucket the cost model prices), and replica 0's mutable buffers
broadcast to the others (``sync_buffers``, Note [buffers across replicas] in runtime/execute/train.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from runtime.program.layout import Layout
from runtime.program.spec import Program
from runtime.parallel.tensor_parallel import create_tensor_groups, local, settle_gradients



def allreduce_flat_(tensors: list[torch.Tensor], group, *, divide_by: int,
                     bucket_elems: int = 1 << 25) -> None:
    """Sum ``tensors`` across ``group`` in place (one all-reduce per dtype bucket), then divide."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group_tensors in by_dtype.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for t in group_tensors + [None]:
            if t is not None and (size + t.numel() <= bucket_elems or not bucket):
                bucket.append(t)
                size += t.numel()
                continue
            flat = torch.cat([b.reshape(-1) for b in bucket])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            if divide_by != 1:
                flat.div_(divide_by)
            offset = 0
            for b in bucket:
                b.copy_(flat[offset:offset + b.numel()].view_as(b))
                offset += b.numel()
            bucket, size = ([t], t.numel()) if t is not None else ([], 0)


def _broadcast_flat_(tensors: list[torch.Tensor], src: int, group) -> None:
    """Overwrite ``tensors`` with rank ``src``'s values (one broadcast per dtype)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group_tensors in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in group_tensors])
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        for t in group_tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


@dataclass
class Groups:
    """This rank's process groups (None where the group would have one member)."""

    pipeline: object
    data_parallel: object | None
    ties: list[object | None] = field(default_factory=list)  # per program tie
    tensor: object | None = None  # this rank's tensor group (tp > 1, runtime/parallel/tensor_parallel.py)


def create_groups(layout: Layout, rank: int, *, timeout, backend: str | None = None) -> Groups:
    """Create every group on every rank in one fixed order (Note [group order] in runtime/program/layout.py)."""
    mine_pipeline = layout.pipeline_index(rank)
    pipeline = dp_group = None
    ties: list = []
    for index, ranks in enumerate(layout.pipelines):
        g = dist.new_group(list(ranks), timeout=timeout, backend=backend)
        if index == mine_pipeline:
            pipeline = g
    for ranks in layout.dp_groups:
        if len(ranks) > 1:
            g = dist.new_group(list(ranks), timeout=timeout, backend=backend)
            if rank in ranks:
                dp_group = g
    for per_replica in layout.tie_groups:
        mine = None
        for index, ranks in enumerate(per_replica):
            if len(ranks) > 1:
                g = dist.new_group(list(ranks), timeout=timeout, backend=backend)
                if index == mine_pipeline:
                    mine = g
        ties.append(mine)
    return Groups(pipeline, dp_group, ties, create_tensor_groups(layout, rank, timeout=timeout, backend=backend))


def sync_gradients(modules: list[torch.nn.Module], program: Program, groups: Groups, *,
                   data_parallel: bool = True) -> None:
    """Tie gradients: sum over every copy (local copies, then across the tie group of this
    replica). Then data-parallel: average every gradient over the replicas. Every rank runs the
    ties in program order, then data parallelism, so the collectives never cross."""
    params = [p for m in modules for p in m.parameters()]
    if program.tensor_parallel > 1:  # Note [tensor-parallel stages] in runtime/parallel/tensor_parallel.py
        settle_gradients(params)
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    for tie, group in zip(program.ties, groups.ties):
        copies = [m.get_parameter(tie.param) for m in modules if m.stage_index in tie.stages]
        if not copies:
            continue
        total = copies[0].grad.clone()
        for c in copies[1:]:
            total.add_(c.grad)
        if group is not None:  # a DTensor's local piece: the tie group is one tensor index's
            dist.all_reduce(local(total), op=dist.ReduceOp.SUM, group=group)
        for c in copies:
            c.grad.copy_(total)
    if data_parallel and groups.data_parallel is not None:
        allreduce_flat_([local(p.grad) for p in params], groups.data_parallel, divide_by=program.dp)


def sync_buffers(buffers: list[torch.Tensor], layout: Layout, rank: int, groups: Groups) -> None:
    """Every replica takes replica 0's mutable buffers (Note [buffers across replicas]). The
    members of a data-parallel group hold the same stages, so they agree on whether to call."""
    if groups.data_parallel is None or not buffers:
        return
    src = next(ranks for ranks in layout.dp_groups if rank in ranks)[0]  # replica 0's rank
    with torch.no_grad():
        _broadcast_flat_(buffers, src, groups.data_parallel)
