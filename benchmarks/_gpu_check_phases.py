"""The phases of the one-GPU check (benchmarks/gpu_check.py), each run in a process of its own
(``python benchmarks/gpu_check.py _phase NAME ...``) so that a CUDA error or a hang in one leaves the
others untouched. Each writes its findings to WORK/NAME.json as it goes (``Answers``) and sets
``error`` to the first thing that went wrong; it never stops at a failed run.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks._gpu_check_runs import REPO, Answers, compare_losses, run_folder


@dataclass
class Context:
    folders: Path
    work: Path
    device: str           # "cuda" or, in the dry run, "cpu"
    dry_run: bool
    manifest: dict
    deadline: float       # time.monotonic() by which the phase must be done

    def left(self, margin: float = 5.0) -> float:
        return max(1.0, self.deadline - time.monotonic() - margin)

    def folder(self, name: str) -> Path:
        return self.folders / name

    def pick(self, real, dry):
        return dry if self.dry_run else real


def _fail(out: Answers, what: str) -> None:
    if out.get("error") is None and what:
        out["error"] = what[:500]


def _run(ctx: Context, out: Answers, key: str, folder: str, flags: list[str], **kw) -> dict:
    entry = ctx.manifest["folders"].get(folder, {})
    if not entry.get("ok"):
        record = {"name": key, "folder": folder, "ok": False, "skipped": True,
                  "error": f"folder {folder} not prepared: {entry.get('error', 'absent from the manifest')}"}
    else:
        record = run_folder(ctx.folder(folder), ctx.work, key, flags, timeout_s=ctx.left(), **kw)
        if entry.get("fallback"):  # e.g. compiled at fp32 because the default precision failed to compile
            record["prepared"] = f"{entry['fallback']}: {entry.get('error')}"
    runs = out.get("runs", [])
    out["runs"] = runs + [record]
    if not record["ok"] and not record.get("skipped"):
        _fail(out, f"{key}: {record['error']}")
    return record


def _python(code: str, timeout_s: float) -> str:
    """``code`` in a fresh interpreter at the repository root: its last output line, or its error."""
    try:
        done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                              timeout=timeout_s, env={**os.environ, "PYTHONPATH": str(REPO)})
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout_s:.0f} s"
    lines = (done.stdout.strip() or done.stderr.strip()).splitlines()
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if "Error" in line or "error" in line]
        return f"error: {(errors or lines or ['exit ' + str(done.returncode)])[-1][:300]}"
    return lines[-1] if lines else "ok"


_NO_ORTOOLS = ("import sys, importlib.abc\n"
               "class B(importlib.abc.MetaPathFinder):\n"
               "    def find_spec(self, name, path, target=None):\n"
               "        if name.split('.')[0] == 'ortools': raise ImportError('ortools is not installed here')\n"
               "sys.meta_path.insert(0, B())\n")


# -- P0 ------------------------------------------------------------------------------------------

def p0_env(ctx: Context, out: Answers) -> None:
    """Versions against the pins, the GPU, the flags that decide determinism and precision."""
    import platform  # lazy: only this phase reports it
    from importlib import metadata  # lazy: only this phase reports versions

    import torch  # lazy: the parent process never loads torch

    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            pins[name.strip()] = version.strip()
    out["python"] = platform.python_version()
    out["torch"] = torch.__version__
    out["pinned"] = {k: pins.get(k) for k in ("torch", "transformers", "safetensors", "zstandard", "numpy")}
    out["cuda_available"] = torch.cuda.is_available()
    out["cuda"] = torch.version.cuda
    versions = {}
    for module in ("transformers", "safetensors", "zstandard", "numpy", "triton", "ortools"):
        try:  # installed, by its metadata (importing transformers alone takes seconds)
            versions[module] = metadata.version(module)
        except metadata.PackageNotFoundError:
            versions[module] = None
    out["packages"] = versions
    out["nccl_available"] = bool(torch.distributed.is_nccl_available())
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out["gpu"] = {"name": p.name, "sms": p.multi_processor_count, "memory_bytes": p.total_memory,
                      "capability": list(torch.cuda.get_device_capability(0)), "count": torch.cuda.device_count(),
                      "bf16": torch.cuda.is_bf16_supported()}
        nccl = torch.cuda.nccl.version() if out["nccl_available"] else None
        out["nccl"] = list(nccl) if isinstance(nccl, tuple) else nccl
        out["cudnn"] = torch.backends.cudnn.version()
        out["free_bytes_at_start"] = torch.cuda.mem_get_info()[0]
    out["flags"] = {"tf32_matmul": torch.backends.cuda.matmul.allow_tf32, "tf32_cudnn": torch.backends.cudnn.allow_tf32,
                    "cudnn_deterministic": torch.backends.cudnn.deterministic,
                    "cudnn_benchmark": torch.backends.cudnn.benchmark,
                    "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
                    "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}
    try:
        st = os.statvfs("/dev/shm")
        out["dev_shm_bytes"] = {"size": st.f_frsize * st.f_blocks, "free": st.f_frsize * st.f_bavail}
    except OSError as exc:
        out["dev_shm_bytes"] = f"error: {exc}"
    smi = shutil.which("nvidia-smi")
    out["nvidia_smi"] = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                                       capture_output=True, text=True, timeout=30).stdout.strip() if smi else None
    # Program folders run where OR-Tools is not installed (issue 40 item 4): which entry points import
    checks = ("runtime.launch.rank", "runtime.execute.train", "runtime.execute.reference", "partitioner.models.generate",
              "partitioner.models.export", "partitioner.cli.run", "partitioner.cli.verify")
    found = _python(_NO_ORTOOLS + "import importlib, json\nfound = {}\n"
                    f"for name in {checks!r}:\n"
                    "    try:\n        importlib.import_module(name); found[name] = 'ok'\n"
                    "    except Exception as exc:\n        found[name] = f'{type(exc).__name__}: {exc}'\n"
                    "print(json.dumps(found))", 120)
    try:
        out["imports_without_ortools"] = json.loads(found)
    except ValueError:
        out["imports_without_ortools"] = found
    if not ctx.dry_run and not out["cuda_available"]:
        _fail(out, "no CUDA device: every later phase will fail")


# -- P1 ------------------------------------------------------------------------------------------

def _probe(ctx: Context, names: list[str], timeout_s: float = 60) -> dict:
    """One process asking the one-process probes ``names`` in turn: name -> its answers."""
    path = ctx.work / "probe.json"
    paths = {name: ctx.work / (f"probe_{name}.json" if len(names) > 1 else "probe.json") for name in names}
    for p in paths.values():
        p.unlink(missing_ok=True)
    try:
        done = subprocess.run([sys.executable, "-m", "benchmarks._gpu_check_probes", ",".join(names), ctx.device,
                               str(path)], cwd=REPO, capture_output=True, text=True,
                              timeout=min(timeout_s, ctx.left()), env={**os.environ, "PYTHONPATH": str(REPO)})
        code, tail = done.returncode, done.stderr.strip().splitlines()[-3:]
    except subprocess.TimeoutExpired:
        code, tail = None, ["timed out"]
    results = {name: dict(Answers.load(p)) for name, p in paths.items()}
    if code not in (0, 1):  # 1: a probe raised, and said so in its own file
        for answers in results.values():
            if not answers:
                answers["error"] = f"exit {code}: {' | '.join(tail)[:300]}"
    return results


def _pair(ctx: Context, name: str, timeout_s: float) -> dict:
    """Two processes of probe ``name`` (ranks 0 and 1) on one device; each rank's answers."""
    from runtime.launch.torchrun import free_port, run_env  # lazy: the same environment as a run's ranks

    port = str(free_port())
    paths = [ctx.work / f"probe_{name}_{r}.json" for r in range(2)]
    procs = []
    for r, path in enumerate(paths):
        path.unlink(missing_ok=True)
        procs.append(subprocess.Popen([sys.executable, "-m", "benchmarks._gpu_check_probes", name, ctx.device,
                                       str(path), str(r), port], cwd=REPO, env=run_env(pythonpath=str(REPO)),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        if r == 0:
            time.sleep(1.0)  # rank 0 hosts the store
    answers = {}
    deadline = time.monotonic() + min(timeout_s, ctx.left())
    for r, proc in enumerate(procs):
        try:
            _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            code = proc.returncode
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            code = None
        got = Answers.load(paths[r])
        if code != 0:
            got.setdefault("error", f"exit {code}: {' | '.join(err.strip().splitlines()[-2:])[:300]}")
        answers[f"rank_{r}"] = got
    return answers


def p1_probes(ctx: Context, out: Answers) -> None:
    """Fused AdamW alone (an illegal memory access would poison the others' CUDA context); the
    rest together, the riskiest last."""
    cuda = ctx.device.startswith("cuda")
    out.update(_probe(ctx, ["keyed_draw", "timing", "cpu_tensor_on_nccl", "sdpa_backward_bitwise"], timeout_s=120))
    out.update(_probe(ctx, ["fused_adamw_cpu_step"], timeout_s=60))
    out["gloo_collectives_on_device"] = _pair(ctx, "gloo_rank", 60)
    out["nccl_two_ranks_one_gpu"] = _pair(ctx, "nccl_rank", 45) if cuda else {"skipped": "no CUDA here"}
    for key in ("keyed_draw", "timing", "sdpa_backward_bitwise", "fused_adamw_cpu_step"):
        if "error" in out.get(key, {}):
            _fail(out, f"{key}: {out[key]['error']}")
    out.save()


# -- P2 ------------------------------------------------------------------------------------------

def p2_eager(ctx: Context, out: Answers) -> None:
    """bf16 eager (eval, checkpoints, memory), then the same killed at an unannounced step and
    resumed by torchrun's restart, then text generated on the device from its checkpoint."""
    steps, every, eval_every, fail = ctx.pick((30, 10, 15, 17), (8, 3, 4, 5))
    common = ["--steps", str(steps), "--checkpoint-every", str(every), "--measure-memory"]
    eager = _run(ctx, out, "P2 eager bf16", "gpt_bf16", common + ["--eval-every", str(eval_every), "--eval-batches", "2"])
    resumed = _run(ctx, out, "P2 killed and resumed", "gpt_bf16", common + ["--fail-at", f"0:{fail}:kill"],
                   max_restarts=1)
    out["resume_vs_uninterrupted"] = {"killed_before_step": fail, "checkpoint_every": every,
                                      **compare_losses(eager.get("losses"), resumed.get("losses"))}
    if eager["ok"]:
        out["generate"] = _generate(ctx, Path(eager["run_dir"]).parent / "checkpoints")
        if "error" in out["generate"]:
            _fail(out, f"generate: {out['generate']['error']}")


def _generate(ctx: Context, checkpoints: Path) -> dict:
    try:
        from partitioner.models.generate import SamplingSettings, generate  # lazy: loads the model code

        started = time.perf_counter()
        done = generate(ctx.folder("gpt_bf16"), "The runtime ", SamplingSettings(
            max_new_tokens=16, temperature=0.0, device=ctx.device), checkpoint_dir=checkpoints)
        return {"ok": True, "text": done.text[-200:], "new_tokens": len(done.new_ids), "step": done.step,
                "seconds": round(time.perf_counter() - started, 2)}
    except Exception as exc:  # noqa: BLE001 - recorded
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}


# -- P3, P5, P6 ----------------------------------------------------------------------------------

def p3_fp16(ctx: Context, out: Answers) -> None:
    """fp16 with loss scaling and clipping through the norm all-reduce; the reference run of P5."""
    steps = ctx.pick(20, 8)
    _run(ctx, out, "P3 fp16 clip", "gpt_fp16_clip", ["--steps", str(steps), "--checkpoint-every", "0",
                                                     "--measure-memory"])


def p5_tiers(ctx: Context, out: Answers) -> None:
    """The memory tier (a copy of the state every step in host shared memory), lossless checkpoints,
    a kill and a restart that recovers from them; losses held to P3's uninterrupted run; export."""
    steps, every, fail = ctx.pick((20, 5, 13), (8, 3, 5))
    shm = Path("/dev/shm")
    try:
        st = os.statvfs(shm)
        roomy = st.f_frsize * st.f_bavail >= ctx.pick(4 * 2**30, 2**26)
    except OSError:
        roomy = False
    memory_dir = shm if roomy else ctx.work / "memory_tier"  # a container's /dev/shm is often 64 MB
    memory_dir.mkdir(parents=True, exist_ok=True)
    out["memory_dir"] = str(memory_dir)
    run = _run(ctx, out, "P5 memory tier + lossless, killed and resumed", "gpt_fp16_clip",
               ["--steps", str(steps), "--memory-tier", "none", "--memory-dir", str(memory_dir),
                "--checkpoint-compression", "lossless", "--checkpoint-every", str(every), "--fail-at",
                f"0:{fail}:kill", "--measure-memory"], max_restarts=1)
    reference = Answers.load(ctx.work / "P3.json").get("runs", [{}])[0].get("losses")
    out["resume_vs_P3"] = {"killed_before_step": fail, **compare_losses(reference, run.get("losses"))}
    if run["ok"]:
        try:
            from partitioner.models.export import export  # lazy: loads safetensors

            target = ctx.work / "P5_export"
            shutil.rmtree(target, ignore_errors=True)  # export never overwrites
            report = export(Path(run["run_dir"]).parent / "checkpoints", target,
                            program_dir=ctx.folder("gpt_fp16_clip"))
            out["export"] = {"ok": True, "step": getattr(report, "step", None)}
        except Exception as exc:  # noqa: BLE001 - recorded
            out["export"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
            _fail(out, f"export: {out['export']['error']}")


def p6_compiled(ctx: Context, out: Answers) -> None:
    """Compiled stages (inductor, Triton on CUDA): compile seconds, graphs, breaks, step time. The dry
    run turns torch.compile off (inductor's cold compile alone takes minutes on two CPU cores;
    tests/e2e/test_compiled_stages.py covers it there): it checks this phase, not inductor."""
    steps = ctx.pick(20, 4)
    env = {"TORCH_COMPILE_DISABLE": "1"} if ctx.dry_run else {}
    record = _run(ctx, out, "P6 compiled stages", "gpt_compiled", ["--steps", str(steps), "--checkpoint-every", "0",
                                                                   "--measure-memory"], env=env)
    times = record.get("stage_times") or {}
    out["compile"] = {key: times.get(key) for key in ("compile_s", "compiled_graphs", "graph_breaks")}
    out["torch_compile_disabled"] = ctx.dry_run


# -- P4 ------------------------------------------------------------------------------------------

def p4_oracle(ctx: Context, out: Answers) -> None:
    """The dropout GPT (and a tiny hf-llama) trained 3 steps, then held to the one-process oracle on
    the CPU (what verify does today) and on the program's own device where the runtime offers it."""
    for folder in ("gpt_dropout", "hf_llama"):
        record = _run(ctx, out, f"P4 {folder}", folder, ["--steps", "3", "--checkpoint-every", "0", "--measure-memory"])
        if record["ok"]:
            out[f"{folder}_oracle"] = _oracles(ctx, folder, Path(record["run_dir"]), record["losses"])
            for where, verdict in out[f"{folder}_oracle"].items():
                if isinstance(verdict, dict) and verdict.get("error"):
                    _fail(out, f"{folder} oracle on {where}: {verdict['error']}")


def _oracles(ctx: Context, folder: str, run_dir: Path, losses: list) -> dict:
    from safetensors.torch import load_file  # lazy: loads torch (the parent process never does)

    from runtime.execute.reference import train_reference_from_folder  # lazy: loads the runtime

    params = {}
    for path in sorted((run_dir / "final").glob("rank_*.safetensors")):
        params.update(load_file(str(path)))
    takes_device = "device" in inspect.signature(train_reference_from_folder).parameters
    verdicts: dict = {"oracle_takes_device": takes_device}
    for where in dict.fromkeys(("cpu", ctx.device)):
        if where != "cpu" and not takes_device:
            verdicts[where] = {"skipped": "runtime.execute.reference.train_reference_from_folder has no device "
                                          "parameter: the oracle runs on the CPU only"}
            continue
        try:
            kwargs = {"device": where} if takes_device else {}
            ref_losses, state, _ = train_reference_from_folder(str(ctx.folder(folder)), len(losses), **kwargs)
            worst, diff = "-", 0.0
            for name, tensor in params.items():
                d = float((tensor.float() - state[name].detach().float().cpu()).abs().max())
                worst, diff = (name, d) if d > diff else (worst, diff)
            verdicts[where] = {"losses": ref_losses, "max_loss_diff": max(
                abs(a - b) / max(1.0, abs(b)) for a, b in zip(losses, ref_losses)),
                "max_param_diff": diff, "worst_param": worst}
        except Exception as exc:  # noqa: BLE001 - recorded
            verdicts[where] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
    return verdicts


# -- P7 ------------------------------------------------------------------------------------------

def p7_multi_rank(ctx: Context, out: Answers) -> None:
    """Two data-parallel ranks on the one GPU (Note [every rank on one GPU] in runtime/launch/world.py):
    the gradient all-reduce, the buffer broadcast and the replica digests on CUDA tensors through
    gloo, dropout on, held to the one-process oracle. Not NCCL: what needs two GPUs is listed."""
    record = _run(ctx, out, "P7 dp 2 on one GPU", "gpt_dp2", ["--steps", "4", "--checkpoint-every", "2",
                                                              "--measure-memory"],
                  nproc=2, env={"PARTITIONER_ONE_GPU_RANKS": "1"})
    if record["ok"]:
        out["gpt_dp2_oracle"] = _oracles(ctx, "gpt_dp2", Path(record["run_dir"]), record["losses"])
        for where, verdict in out["gpt_dp2_oracle"].items():
            if isinstance(verdict, dict) and verdict.get("error"):
                _fail(out, f"gpt_dp2 oracle on {where}: {verdict['error']}")
    out["needs_two_gpus"] = ["NCCL between ranks (all-reduce, ZeRO's reduce-scatter, pipeline sends, tensor "
                             "parallelism's collectives, the canary exchange)", "cuda:LOCAL_RANK per rank",
                             "the elastic re-plan's groups", "NCCL's watchdog on a killed peer",
                             "NCCL's memory per communicator"]


# P7 before P6: compiled stages' compile time is the least certain, so it goes last in the budget
PHASES = {"P0": ("env", p0_env), "P1": ("probes", p1_probes), "P2": ("eager bf16, kill and resume, eval, generate",
                                                                    p2_eager),
          "P3": ("fp16 + clipping", p3_fp16), "P4": ("verify against the oracle", p4_oracle),
          "P5": ("memory tier, lossless, resume, export", p5_tiers), "P7": ("dp 2 on one GPU", p7_multi_rank),
          "P6": ("compiled stages", p6_compiled)}
