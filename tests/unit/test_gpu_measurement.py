"""What a CUDA program measures and which kernels it runs, checked on a machine without a GPU: the
clock picked by device type (Note [timing on a device]), the kernel settings a CUDA rank starts
with (Note [deterministic kernels on a GPU]), and the figures the runtime reports from plan.json."""

from __future__ import annotations

import ast
import json
import importlib
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---- D1, D2: timing GPU work, not its launch ----------------------------------------------------

def test_a_cuda_device_is_timed_by_events_and_a_cpu_by_the_host_clock():
    from runtime.observe.clock import EventClock, HostClock, clock_for
    from runtime.observe.stage_times import StageTimes

    assert isinstance(clock_for(torch.device("cuda", 3)), EventClock)
    assert isinstance(clock_for("cuda"), EventClock)
    assert isinstance(clock_for("cpu"), HostClock) and isinstance(clock_for(torch.device("meta")), HostClock)
    # the trainer's stage timer takes the clock of the rank's device
    assert StageTimes([], [], 1, torch.device("cuda", 0)).clock.kind == "cuda_events"
    assert StageTimes([], [], 1, torch.device("cpu")).clock.kind == "perf_counter"


class _Recorded:
    """A reached CUDA event's two methods the clock reads (no CUDA here to record a real one)."""

    def __init__(self, ms):
        self.ms, self.waited = ms, False

    def synchronize(self):
        self.waited = True

    def elapsed_time(self, end):
        return end.ms - self.ms


def test_event_spans_are_added_at_settle_in_seconds_and_discarded_outside_a_step():
    from runtime.observe.clock import EventClock

    clock, sums = EventClock(), [0.0, 0.0]
    a, b, c = _Recorded(1.0), _Recorded(251.0), _Recorded(301.0)
    clock.add(a, b, sums, 0)
    clock.add(b, c, sums, 1)
    assert sums == [0.0, 0.0]  # nothing read before the step's sync
    clock.settle()
    assert sums == [0.25, 0.05] and b.waited and c.waited and not clock.pending
    clock.add(a, c, sums, 0)
    clock.discard()
    clock.settle()
    assert sums == [0.25, 0.05]


def test_the_trainer_settles_its_stage_times_after_the_steps_loss_is_read():
    """Event marks are readable once the step's final sync (the loss's float) has passed them:
    ``end_step`` must come after it in ``train_step``."""
    from runtime.execute import train

    tree = ast.parse(open(train.__file__).read())
    step = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "train_step")
    lines = {}
    for node in ast.walk(step):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            lines.setdefault(name, node.lineno)
    assert lines["float"] < lines["self.stage_times.end_step"]
    assert "time.perf_counter" not in lines  # the phases are the clock's marks


def test_calibrate_reads_no_clock_without_waiting_for_the_device():
    measure = importlib.import_module("partitioner.calibrate.measure")  # the package exports a function of that name
    calls = {ast.unparse(n.func) for n in ast.walk(ast.parse(open(measure.__file__).read()))
             if isinstance(n, ast.Call)}
    assert "time.perf_counter" not in calls and "sync_now" in calls


# ---- B5, C3, C1 (TF32): the kernels a CUDA rank runs ------------------------------------------------

def test_a_cuda_program_runs_deterministic_kernels_without_tf32():
    from runtime.execute.precision import numerics_for

    for policy in ("fp32", "bf16-mixed", "fp16-mixed"):
        got = numerics_for("cuda", policy, environ={}).as_dict()
        assert got == {"deterministic_algorithms": True, "cublas_workspace_config": ":4096:8",
                       "cudnn_deterministic": True, "cudnn_benchmark": False,
                       "matmul_allow_tf32": False, "cudnn_allow_tf32": False}
    # the user's own deterministic workspace setting is kept; a nondeterministic one is not
    assert numerics_for("cuda", "fp32", environ={"CUBLAS_WORKSPACE_CONFIG": ":16:8"}).cublas_workspace_config == ":16:8"
    assert numerics_for("cuda", "fp32", environ={"CUBLAS_WORKSPACE_CONFIG": ":0:0"}).cublas_workspace_config == ":4096:8"
    assert numerics_for("cpu", "fp32").as_dict() == {}  # CPU kernels are deterministic already
    with pytest.raises(ValueError, match="'fp8' is not one of"):
        numerics_for("cuda", "fp8")


def test_device_numerics_sets_the_process_flags_for_cuda_and_none_for_cpu():
    """In a fresh process (the flags are process-wide): what a CUDA rank starts with, and that a
    CPU rank leaves torch's defaults alone."""
    probe = ("import os, sys, torch\n"
             "from runtime.execute.precision import device_numerics\n"
             "device_numerics(sys.argv[1], 'bf16-mixed')\n"
             "print(os.environ.get('CUBLAS_WORKSPACE_CONFIG'), torch.are_deterministic_algorithms_enabled(),\n"
             "      torch.is_deterministic_algorithms_warn_only_enabled(), torch.backends.cudnn.deterministic,\n"
             "      torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)\n")
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("CUBLAS_WORKSPACE_CONFIG", None)
    out = {dev: subprocess.run([sys.executable, "-c", probe, dev], env=env, capture_output=True, text=True,
                               timeout=120, check=True).stdout.split() for dev in ("cuda", "cpu")}
    assert out["cuda"] == [":4096:8", "True", "True", "True", "False", "False", "False"]
    assert out["cpu"] == ["None", "False", "False", "False", "False", "False", "True"]


def test_the_rank_sets_its_kernels_before_any_cuda_work():
    """CUBLAS_WORKSPACE_CONFIG is read when cuBLAS makes its first handle: the rank's call must
    come before set_device (rank_device), the process group and the trainer."""
    from runtime.launch import rank

    tree = ast.parse(open(rank.__file__).read())
    main = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_start")
    first = {}
    for node in ast.walk(main):
        if isinstance(node, ast.Call):
            first.setdefault(ast.unparse(node.func), node.lineno)
    # rank_device sets the CUDA device, init_group makes the process group
    assert first["device_numerics"] < min(first["rank_device"], first["init_group"], first["RankTrainer"])
    call = next(n for n in ast.walk(main) if isinstance(n, ast.Call) and ast.unparse(n.func) == "device_numerics")
    assert [ast.unparse(a) for a in call.args] == ["program.device", "program.precision"]


# ---- D4: MFU against the datasheet peak -----------------------------------------------------------

def test_mfu_of_a_gpu_program_divides_by_the_datasheet_peak_of_its_world(tmp_path):
    """An h100 program at bf16-mixed: 989 TFLOP/s per rank (not the sustained 396 the cost model
    prices with); at fp32, 67 (TF32 is off: Note [deterministic kernels on a GPU])."""
    import partitioner
    from partitioner.config.cluster import ClusterSpec
    from partitioner.models.builtin import gpt
    from runtime.observe.watch import plan_step_flops
    from runtime.program.spec import load_program

    for precision, per_rank in (("bf16-mixed", 989e12), ("fp32", 67e12)):
        folder = tmp_path / precision
        plan = partitioner.compile(gpt(layers=2, width=32, heads=2, vocab=64, seq=16, device="meta"),
                                   cluster=ClusterSpec.homogeneous(2, "h100"), global_batch=8, num_stages=2,
                                   microbatches=4, precision=precision)
        plan.save(folder)
        assert load_program(str(folder)).peak_flops_per_s == pytest.approx(2 * per_rank)
        flops, peak = plan_step_flops(str(folder))
        assert flops > 0 and peak == pytest.approx(2 * per_rank)


def test_a_cpu_programs_mfu_counts_each_rank_once(tmp_path):
    """No datasheet on cpu: the cluster's nominal rate of each rank's kind, each rank once (a
    tensor group's ranks all count; an interleaved rank's stages do not count twice)."""
    from runtime.observe.watch import plan_step_flops
    from partitioner.config.device_presets import world_peak_flops_per_s

    class Stage:
        def __init__(self, ranks, device):
            self.ranks, self.device = ranks, device

    stages = [{"flops_fwd": 1.0, "flops_bwd": 2.0, "ranks": [0], "device": "cpu"},
              {"flops_fwd": 1.0, "flops_bwd": 2.0, "ranks": [2], "device": "cpu"},
              {"flops_fwd": 1.0, "flops_bwd": 2.0, "ranks": [0], "device": "cpu"}]  # interleaved: rank 0 again
    body = {"stages": stages, "num_microbatches": 2, "dp": 1, "tensor_parallel": 2, "program": {},
            "cluster": {"group": [{"kind": "cpu", "flops_per_s": 5.0}]}}
    (tmp_path / "plan.json").write_text(json.dumps(body))
    assert plan_step_flops(str(tmp_path)) == (18.0, 20.0)  # ranks 0, 1, 2, 3
    assert world_peak_flops_per_s([Stage(s["ranks"], s["device"]) for s in stages], 2, "fp32") is None
    assert world_peak_flops_per_s([Stage([0, 2], "h100"), Stage([1, 3], "a100")], 1, "bf16") == 2 * 989e12 + 2 * 312e12


# ---- E3: compile threads ----------------------------------------------------------------------------

def test_a_cpu_rank_compiles_on_one_thread_even_after_inductor_read_its_config(monkeypatch):
    """The rank has imported torch.distributed.pipelining (and with it inductor's config, which read
    TORCHINDUCTOR_COMPILE_THREADS then) before a stage compiles: the setting must reach the config."""
    import torch.distributed.pipelining  # noqa: F401 - what a rank has loaded before compile_stage
    import torch._inductor.config as inductor_config
    from runtime.execute.compile_stages import compile_stage

    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    monkeypatch.setattr(inductor_config, "compile_threads", 7)
    compile_stage(torch.nn.Linear(2, 2), "cpu")
    assert inductor_config.compile_threads == 1


def test_a_gpu_rank_compiles_on_its_share_of_the_hosts_cores():
    from runtime.execute.compile_stages import compile_threads

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert compile_threads("cpu", environ={}) == 1
    assert compile_threads("cuda", environ={"LOCAL_WORLD_SIZE": "1"}) == min(32, cores)
    assert compile_threads("cuda", environ={"LOCAL_WORLD_SIZE": str(cores * 2)}) == 1
    assert compile_threads("cuda", environ={"TORCHINDUCTOR_COMPILE_THREADS": "3"}) == 3  # the user's wins


# ---- D3: what a GPU holds beyond the tensors -----------------------------------------------------------

def test_the_memory_report_carries_reserved_and_device_wide_bytes_and_says_when_reserved_is_over(tmp_path, capsys):
    """A CUDA meter's figures (what ``cuda_memory_figures`` reads at stop) go into memory_rank_<r>.json
    and the printed line; reserved above the plan's capacity is said even when allocated is below.
    A real one-rank gloo group: the report is a collective."""
    import torch.distributed as dist
    from runtime.observe.memory import PeakMemory, report
    from runtime.observe.watch import memory_row

    class Trainer:
        device, stage_ids, modules = torch.device("cpu"), (0,), ()

    (tmp_path / "plan.json").write_text(json.dumps({"stages": [
        {"index": 0, "peak_memory_bytes": 600 * 2**20, "memory_capacity_bytes": 1000 * 2**20}]}))
    meter = PeakMemory(Trainer())
    meter.peak_bytes = 700 * 2**20
    meter.figures = {"measured_peak_reserved_bytes": 1100 * 2**20, "device_used_bytes": 1600 * 2**20,
                     "device_total_bytes": 80 * 2**30}
    store = dist.HashStore()
    dist.init_process_group("gloo", rank=0, world_size=1, store=store)
    try:
        report(meter, folder=str(tmp_path), rank=0, run_dir=str(tmp_path / "run"))
    finally:
        dist.destroy_process_group()
    row = json.loads((tmp_path / "run" / "memory_rank_0.json").read_text())
    assert row["measured_peak_reserved_bytes"] == 1100 * 2**20 and row["device_used_bytes"] == 1600 * 2**20
    line = capsys.readouterr().out
    assert ("rank 0 700.00 MiB / 600.00 MiB / 1000.00 MiB (reserved 1100.00 MiB, device used 1600.00 MiB, "
            "reserved over capacity)") in line
    # a CPU rank's per-step row is its one peak, as before
    assert memory_row(torch.device("cpu"))[1] == ("peak_memory_bytes",)


# ---- E2: one wait per snapshot ------------------------------------------------------------------------

def test_steps_are_read_as_float_reads_them_and_host_copies_are_fresh_clones():
    """The CPU path of Note [one wait per snapshot] keeps every byte and float (checkpoint files
    stay the same); a CUDA tensor takes the pinned, non-blocking path, which needs a GPU."""
    from runtime.execute.host_copy import host_copies, step_values

    steps = [("a", torch.tensor(3.0)), ("b", 7), ("c", torch.tensor(2**24 + 1, dtype=torch.int64)),
             ("d", torch.tensor(0.1, dtype=torch.float32))]
    got = step_values(steps)
    assert list(got) == ["a", "b", "c", "d"] and got == {n: float(v) for n, v in steps}
    live = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3).t(), "n": torch.tensor([True, False])}
    copies = host_copies(live.items())
    for name, t in live.items():
        assert torch.equal(copies[name], t) and copies[name].dtype == t.dtype
        assert copies[name].untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


# ---- E1: the memory tier's copy from a GPU ---------------------------------------------------------------

def test_the_staged_copy_moves_every_byte_through_two_small_buffers_and_waits_for_each_chunk():
    """The chunking of Note [memory tier copy on a GPU], run on CPU tensors with 7-byte buffers
    (chunks cross element and tensor boundaries); on a GPU ``record``/``wait`` are CUDA events."""
    from runtime.resilience.memtier.staging import staged_copy

    sources = [torch.randn(10), torch.arange(3, dtype=torch.int64) * 2**40, torch.tensor([True, False] * 3),
               torch.tensor(2.5, dtype=torch.float64), torch.randn(4, 3).t()]  # the last: not contiguous
    dests = [torch.empty(s.shape, dtype=s.dtype) for s in sources]
    marks, waited = [], []

    def record():
        marks.append(len(marks))
        return marks[-1]

    staged_copy(list(zip(sources, dests)), [torch.empty(7, dtype=torch.uint8), torch.empty(9, dtype=torch.uint8)],
                record=record, wait=waited.append)
    for s, d in zip(sources, dests):
        assert torch.equal(s, d)
    total = sum(s.numel() * s.element_size() for s in sources)
    assert len(marks) == sum(-(-s.numel() * s.element_size() // 7) for s in sources) and total > 7
    assert sorted(waited) == marks  # every chunk waited for once before its bytes were used
