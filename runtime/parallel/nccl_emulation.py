"""NCCL's device rules on a CPU run, for the test suite: with PARTITIONER_EMULATE_NCCL=1 in a rank's
environment, the groups NCCL would serve refuse what NCCL refuses (runtime/launch/rank.py enters
``emulated()`` around the run; never set outside tests).

Note [NCCL emulation]: on a CPU run every tensor is on the program's device, so a collective that
would get a CPU tensor under NCCL passes under gloo and the mistake only shows on the first GPU
run. So a TorchFunctionMode in the rank's main thread marks each tensor "host" where it would be
on the host on a GPU (a factory without a device, ``.cpu()``, a device written as the string
"cpu", and what ops make of host inputs, as CUDA does); a ``torch.device`` object is trusted (the
program's device and the CPU cannot be told apart on a CPU run: tests/unit/test_collective_devices.py
lints what that leaves). Then NCCL's rules are enforced with NCCL's messages: the device groups
refuse a host tensor (gloo groups, Note [the control group] in runtime/parallel/control.py, take
anything); the runtime's ``isend``/``irecv`` on them must be inside ``batch_isend_irecv`` (NCCL's
point-to-point calls progress only when both sides are posted: two ranks that each send first
wait forever, as the canary exchange at dp 2 did); fused AdamW refuses a host ``step`` (CUDA's
kernel reads it on the device). DTensor's functional collectives bypass it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.overrides import TorchFunctionMode

ENV = "PARTITIONER_EMULATE_NCCL"
_TAG = "_partitioner_host"
_COLLECTIVES = ("allreduce", "allreduce_coalesced", "allgather", "_allgather_base", "allgather_coalesced",
                "allgather_into_tensor_coalesced", "all_gather_single", "all_gather_single_coalesced",
                "broadcast", "reduce", "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single",
                "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced", "gather", "scatter",
                "alltoall", "alltoall_base", "all_to_all_single", "send", "recv", "recv_anysource")
_state = threading.local()


def requested() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def is_host(t) -> bool:
    """Would ``t`` be on the host on a GPU run (Note [NCCL emulation])?"""
    return bool(getattr(t, _TAG, False))


def _tensors(x, depth=0):
    if isinstance(x, torch.Tensor):
        yield x
    elif depth < 3 and isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v, depth + 1)
    elif depth < 3 and isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v, depth + 1)


class _HostDevices:
    """``torch.device`` objects read from host tensors (``t.device``): a factory given one makes a
    host tensor. Kept alive (bounded) so their ids stay theirs."""

    def __init__(self, size=4096):
        self.seen: OrderedDict = OrderedDict()
        self.size = size

    def add(self, d):
        self.seen[id(d)] = d
        if len(self.seen) > self.size:
            self.seen.popitem(last=False)

    def __contains__(self, d):
        return self.seen.get(id(d)) is d


def _host_device(d, seen: _HostDevices) -> bool | None:
    """Where an explicit device puts a tensor: True host, False device, None not a device."""
    if isinstance(d, str):
        return torch.device(d).type == "cpu"
    if isinstance(d, torch.device):
        return d in seen
    if isinstance(d, int) and not isinstance(d, bool):
        return False
    return None


_FUSED = tuple(f for f in (getattr(torch, "_fused_adamw_", None), getattr(torch, "_fused_adam_", None)) if f)


class HostTagger(TorchFunctionMode):
    """Marks host tensors as they are made (Note [NCCL emulation])."""

    def __init__(self):
        super().__init__()
        self.devices = _HostDevices()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FUSED:
            _check_fused(args)
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name == "__get__" and isinstance(out, torch.device):
            if args and is_host(args[0]):
                self.devices.add(out)
            return out
        host = self._host(name, args, kwargs)
        if host is None:
            return out
        if name in ("to", "cpu", "cuda", "pin_memory") and args and out is args[0] and host != is_host(out):
            out = out.clone()  # on a GPU a move between host and device makes a new tensor
            if host:
                setattr(out, _TAG, True)
            return out
        inputs = {id(t) for t in _tensors((args, kwargs))}
        for t in _tensors(out):
            if id(t) not in inputs and host:  # an in-place op's result keeps its own mark
                setattr(t, _TAG, True)
        return out

    def _host(self, name, args, kwargs) -> bool | None:
        if name in ("cpu", "pin_memory"):
            return True
        if name in ("cuda",):
            return False
        if name == "to":
            for a in list(args[1:]) + [kwargs.get("device"), kwargs.get("other")]:
                if isinstance(a, torch.Tensor):
                    return is_host(a)
                where = _host_device(a, self.devices)
                if where is not None:
                    return where
            return is_host(args[0]) if args else None
        if kwargs.get("device") is not None:
            where = _host_device(kwargs["device"], self.devices)
            return bool(where)
        tensors = list(_tensors((args, kwargs)))
        if not tensors:
            return True  # a factory on the default device: the host on a GPU
        host = [t for t in tensors if is_host(t)]
        if not host:
            return False
        device = [t for t in tensors if not is_host(t)]
        if not device:
            return True
        if any(t.dim() > 0 for t in device):
            return False
        return any(t.dim() > 0 for t in host)


def _check_fused(args) -> None:
    lists = [a for a in args if isinstance(a, (list, tuple))]
    params = lists[0] if lists else []
    if any(not is_host(p) for p in params) and any(is_host(t) for lst in lists for t in lst):
        raise RuntimeError("Expected all tensors to be on the same device, but found host tensors in fused AdamW "
                           f"({ENV}: the fused CUDA kernel reads each parameter's step on the device; a step "
                           "tensor made without device=p.device is an illegal memory access on a GPU)")


# -- the groups --------------------------------------------------------------------------------


class _Groups:
    def __init__(self):
        self.device: dict[int, object] = {}

    def is_device(self, group) -> bool:
        return group is None or group is dist.group.WORLD or self.device.get(id(group)) is group


_groups = _Groups()


def _refuse_host(method, group, args, kwargs):
    if not _groups.is_device(group):
        return
    for t in _tensors((args, kwargs)):
        if is_host(t):
            raise RuntimeError(
                f"No backend type associated with device type cpu ({ENV}: ProcessGroup.{method} on a group NCCL "
                f"would serve got a {tuple(t.shape)} {t.dtype} tensor made on the host; on a GPU it is a CPU "
                "tensor: make it with device=, or send it on a gloo group)")


def _wrap_method(cls, method):
    orig = cls.__dict__[method]

    def checked(self, *args, **kwargs):
        _refuse_host(method, self, args, kwargs)
        return orig(self, *args, **kwargs)

    return orig, checked


def _wrap_new_group(orig):
    def new_group(*args, **kwargs):
        group = orig(*args, **kwargs)
        backend = kwargs.get("backend", args[2] if len(args) > 2 else None)
        if backend is None and group is not None and group is not c10d.GroupMember.NON_GROUP_MEMBER:
            _groups.device[id(group)] = group
        return group

    return new_group


_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def _from_runtime() -> bool:
    """Whether this point-to-point call is posted by the runtime (or a test), not by torch itself:
    torch's own schedules post lone one-directional sends and receives, in an order NCCL is
    tested with upstream."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    return frame is None or not frame.f_code.co_filename.startswith(_TORCH)


def _wrap_p2p(orig, what):
    def p2p(tensor, *args, **kwargs):
        group = kwargs.get("group", args[1] if len(args) > 1 else None)
        if not getattr(_state, "batched", False) and _groups.is_device(group) and _from_runtime():
            raise RuntimeError(f"{ENV}: dist.{what} outside dist.batch_isend_irecv on a group NCCL would serve: NCCL "
                               "point-to-point calls progress only when both sides are posted, so two ranks that "
                               "each send first wait on each other; post the pair with batch_isend_irecv")
        return orig(tensor, *args, **kwargs)

    return p2p


def _wrap_paired(orig):
    """batch_isend_irecv, and the blocking send and recv (torch 2.13's call isend/irecv): their
    point-to-point calls are posted as NCCL needs them."""
    def paired(*args, **kwargs):
        before = getattr(_state, "batched", False)
        _state.batched = True
        try:
            return orig(*args, **kwargs)
        finally:
            _state.batched = before

    return paired


@contextlib.contextmanager
def emulated():
    """NCCL's rules on this rank while the block runs, when PARTITIONER_EMULATE_NCCL is set;
    else nothing (Note [NCCL emulation])."""
    if not requested():
        yield
        return
    cls = torch._C._distributed_c10d.ProcessGroup
    saved_methods = {}
    for method in _COLLECTIVES:
        if method in cls.__dict__:
            orig, checked = _wrap_method(cls, method)
            saved_methods[method] = orig
            setattr(cls, method, checked)
    # the same wrapper object in both namespaces: P2POp and batch_isend_irecv compare ops by identity
    wrappers = {"isend": _wrap_p2p(c10d.isend, "isend"), "irecv": _wrap_p2p(c10d.irecv, "irecv"),
                "new_group": _wrap_new_group(c10d.new_group),
                **{name: _wrap_paired(getattr(c10d, name)) for name in ("batch_isend_irecv", "send", "recv")}}
    saved = {name: (getattr(dist, name), getattr(c10d, name)) for name in wrappers}
    for name, fn in wrappers.items():
        setattr(dist, name, fn)
        setattr(c10d, name, fn)
    try:
        with HostTagger():
            yield
    finally:
        for name, (a, b) in saved.items():
            setattr(dist, name, a)
            setattr(c10d, name, b)
        for method, orig in saved_methods.items():
            setattr(cls, method, orig)
        _groups.device.clear()
