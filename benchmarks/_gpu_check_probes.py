"""The one-GPU check's probes (phase P1 of benchmarks/gpu_check.py): small questions about how CUDA
and NCCL behave on the machine at hand, each asked in its own process, since a wrong answer can be
an illegal memory access that poisons the CUDA context, or a collective that hangs.

    python -m benchmarks._gpu_check_probes PROBE DEVICE OUT.json [ARGS...]

Each probe writes a JSON object to OUT.json (rewritten as it learns, so a probe killed at its time
limit still says how far it got). DEVICE is "cuda" on the GPU machine and "cpu" in the dry run,
where the same code runs on CPU tensors so that it cannot rot (answers about CUDA are then
"skipped: no CUDA").
"""

from __future__ import annotations

import hashlib
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from benchmarks._gpu_check_runs import Answers
from runtime.launch.torchrun import LOOPBACK, loopback_store


def first_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# -- one process ---------------------------------------------------------------------------------

def probe_cpu_tensor_on_nccl(device: str, out: Answers) -> None:
    """A world-1 NCCL group: does a CPU tensor pass (finding A3 says it is refused), a CUDA one?"""
    if not device.startswith("cuda") or not dist.is_nccl_available():
        out["skipped"] = "no CUDA/NCCL here"
        return
    torch.cuda.set_device(0)
    store = loopback_store(world_size=1, timeout_s=30)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, timeout=timedelta(seconds=30))
    for name, where in (("cpu_tensor", "cpu"), ("cuda_tensor", "cuda")):
        try:
            t = torch.ones(4, device=where)
            dist.all_reduce(t)
            _sync(device)
            out[name] = "ok"
        except Exception as exc:  # noqa: BLE001 - the answer is the error
            out[name] = f"refused: {first_line(exc)}"
    dist.destroy_process_group()


def probe_fused_adamw_cpu_step(device: str, out: Answers) -> None:
    """Fused AdamW after its ``step`` state was put back on the CPU (as a resume does, finding B2):
    an error, a wrong update or the same update as with ``step`` on the device."""
    results = {}
    for where in ("device", "cpu"):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(1024, device=device))
        opt = torch.optim.AdamW([p], lr=1e-2, fused=True)
        p.grad = torch.randn(1024, device=device)
        opt.step()
        st = opt.state[p]
        if where == "cpu":
            st["step"] = torch.tensor(float(st["step"]), dtype=torch.float32)
        try:
            opt.step()
            _sync(device)
            results[where] = p.detach().cpu().clone()
            out[f"step_on_{where}"] = "ok"
        except Exception as exc:  # noqa: BLE001 - the answer is the error
            out[f"step_on_{where}"] = f"error: {first_line(exc)}"
            return
    out["same_update"] = bool(torch.equal(results["device"], results["cpu"]))


def probe_sdpa_backward_bitwise(device: str, out: Answers) -> None:
    """Scaled-dot-product attention's input gradients, twice on the same inputs: bit-identical?
    Without and with deterministic algorithms (findings B5, C3). Small sizes on the CPU."""
    b, h, s, d = (4, 16, 1024, 64) if device.startswith("cuda") else (2, 2, 64, 16)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype) for _ in range(3))
    g = torch.randn(b, h, s, d, device=device, dtype=dtype)

    def grads():
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
        y.backward(g)
        _sync(device)
        return [t.grad.clone() for t in (qq, kk, vv)]

    for mode in ("default", "deterministic"):
        torch.use_deterministic_algorithms(mode == "deterministic")
        try:
            first, second = grads(), grads()
            out[mode] = all(torch.equal(a, c) for a, c in zip(first, second))
        except Exception as exc:  # noqa: BLE001 - the answer is the error
            out[mode] = f"error: {first_line(exc)}"
    torch.use_deterministic_algorithms(False)


def probe_keyed_draw(device: str, out: Answers) -> None:
    """The sha256 of a keyed 1M-element draw (runtime/execute/randomness.py) on this device and on
    the CPU: equal across GPU models only if the draw is device-independent (finding C2)."""
    from runtime.execute import randomness  # lazy: registers the keyed custom op

    if device.startswith("cuda"):
        out["sms"] = torch.cuda.get_device_properties(0).multi_processor_count
    for where in dict.fromkeys((device, "cpu")):
        randomness.set_context(seed=1234, step=7, first_sample=0, microbatch=0)
        flat = randomness.rand([1024, 1024], op="gpu_check.draw", batch_dim=None, device=where)
        rows = randomness.rand([4, 262144], op="gpu_check.rows", batch_dim=0, device=where)
        out[f"sha256_{torch.device(where).type}"] = hashlib.sha256(
            flat.cpu().numpy().tobytes() + rows.cpu().numpy().tobytes()).hexdigest()
    if device.startswith("cuda"):
        out["cuda_equals_cpu"] = out["sha256_cuda"] == out["sha256_cpu"]


def probe_timing(device: str, out: Answers) -> None:
    """A forward of matmuls timed by perf_counter alone (what stage_times.py did, finding D1) and by
    CUDA events / a synchronize: launch time against GPU time. Small sizes on the CPU."""
    rows, width, depth = (8192, 4096, 8) if device.startswith("cuda") else (256, 256, 2)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    layers = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(depth))).to(device, dtype)
    x = torch.randn(rows, width, device=device, dtype=dtype)
    with torch.no_grad():
        for _ in range(2):
            layers(x)
        _sync(device)
        start = time.perf_counter()
        if device.startswith("cuda"):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        layers(x)
        out["perf_counter_s"] = time.perf_counter() - start
        _sync(device)
        out["perf_counter_synced_s"] = time.perf_counter() - start
        if device.startswith("cuda"):
            end.record()
            end.synchronize()
            out["cuda_events_s"] = begin.elapsed_time(end) / 1000.0


# -- two processes -------------------------------------------------------------------------------

# the names runtime/parallel/zero.py calls (torch 2.13 renamed them; 2.11 has only the old ones)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
GLOO_OPS = ("broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
            "send_recv", "batch_isend_irecv", "barrier")


def _gloo_op(name: str, rank: int, device: str) -> str:
    me = torch.full((4,), float(rank + 1), device=device)
    if name == "broadcast":
        dist.broadcast(me, src=0)
        want = torch.full((4,), 1.0)
    elif name == "all_reduce":
        dist.all_reduce(me)
        want = torch.full((4,), 3.0)
    elif name == "reduce":
        dist.reduce(me, dst=0)
        if rank != 0:  # what a non-root rank's buffer holds afterwards is unspecified
            _sync(device)
            return "ok"
        want = torch.full((4,), 3.0)
    elif name == "all_gather":
        parts = [torch.empty(4, device=device) for _ in range(2)]
        dist.all_gather(parts, me)
        me, want = torch.cat(parts), torch.cat([torch.full((4,), 1.0), torch.full((4,), 2.0)])
    elif name == "all_gather_into_tensor":
        whole = torch.empty(8, device=device)
        _ALL_GATHER(whole, me)
        me, want = whole, torch.cat([torch.full((4,), 1.0), torch.full((4,), 2.0)])
    elif name == "reduce_scatter_tensor":
        mine = torch.empty(2, device=device)
        _REDUCE_SCATTER(mine, me)
        me, want = mine, torch.full((2,), 3.0)
    elif name == "send_recv":
        if rank == 0:
            dist.send(me, dst=1)
            want = me.cpu()
        else:
            dist.recv(me, src=0)
            want = torch.full((4,), 1.0)
    elif name == "batch_isend_irecv":
        other = torch.empty(4, device=device)
        peer = 1 - rank
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, me, peer), dist.P2POp(dist.irecv, other, peer)]):
            work.wait()
        me, want = other, torch.full((4,), float(peer + 1))
    else:
        dist.barrier()
        return "ok"
    _sync(device)
    return "ok" if torch.equal(me.cpu(), want) else f"wrong values: {me.cpu().tolist()}"


def gloo_rank(device: str, out: Answers, rank: str, port: str) -> None:
    """One of the two ranks of ``probe_gloo_collectives``: every op of GLOO_OPS on ``device`` tensors."""
    rank_i = int(rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(0)
    store = (loopback_store(int(port), world_size=2, timeout_s=30) if rank_i == 0 else
             dist.TCPStore(LOOPBACK, int(port), 2, False, timedelta(seconds=30)))
    dist.init_process_group("gloo", store=store, rank=rank_i, world_size=2, timeout=timedelta(seconds=10))
    for name in GLOO_OPS:
        try:
            out[name] = _gloo_op(name, rank_i, device)
        except Exception as exc:  # noqa: BLE001 - the answer is the error
            out[name] = f"error: {first_line(exc)}"
            if "timed out" in str(exc).lower() or "connection" in str(exc).lower():
                break  # the peer is gone: every later op would wait out the timeout too
    dist.destroy_process_group()


def nccl_rank(device: str, out: Answers, rank: str, port: str) -> None:
    """One of two NCCL ranks on the same GPU (expected: refused, "Duplicate GPU detected")."""
    rank_i = int(rank)
    torch.cuda.set_device(0)
    store = (loopback_store(int(port), world_size=2, timeout_s=30) if rank_i == 0 else
             dist.TCPStore(LOOPBACK, int(port), 2, False, timedelta(seconds=30)))
    dist.init_process_group("nccl", store=store, rank=rank_i, world_size=2, timeout=timedelta(seconds=20))
    try:
        t = torch.ones(4, device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        out["all_reduce"] = "ok" if float(t[0]) == 2.0 else f"wrong values: {t.tolist()}"
    except Exception as exc:  # noqa: BLE001 - the answer is the error
        out["all_reduce"] = f"refused: {first_line(exc)}"


ONE_PROCESS = {"cpu_tensor_on_nccl": probe_cpu_tensor_on_nccl, "fused_adamw_cpu_step": probe_fused_adamw_cpu_step,
               "sdpa_backward_bitwise": probe_sdpa_backward_bitwise, "keyed_draw": probe_keyed_draw,
               "timing": probe_timing}
RANKS = {"gloo_rank": gloo_rank, "nccl_rank": nccl_rank}


def main(argv: list[str]) -> int:
    """PROBES DEVICE PATH [ARGS...]: PROBES one name, or several one-process probes separated by
    commas, each writing PATH with the probe's name put before ".json"."""
    names, device, path, *extra = argv
    code = 0
    for name in names.split(","):
        out = Answers(path if "," not in names else path.replace(".json", f"_{name}.json"))
        probe = {**ONE_PROCESS, **RANKS}[name]
        try:
            probe(device, out, *extra)
        except Exception as exc:  # noqa: BLE001 - recorded, the parent reads the file
            out["error"] = first_line(exc)
            code = 1
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
