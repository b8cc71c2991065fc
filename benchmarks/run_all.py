"""Run every benchmark of the project, then write results, a summary and plots.

    make bench        # = .venv/bin/python benchmarks/run_all.py

Each benchmark runs as its own subprocess, one after another (two shared cores: running them side
by side would measure each other), with a timeout; its stdout and stderr are kept. Written to
benchmarks/results/:

    results.json           every benchmark's command, exit code, seconds, stdout, and the parsed
                           tables (solver scaling, plan quality, cost model accuracy)
    summary.md             the tables and each benchmark's closing lines, verbatim
    solver_time.png        solver time vs number of regions, one line per stage count
    plan_quality.png       predicted step time of our plan vs the uniform and parameter-balanced splits
    cost_model.png         predicted vs measured stage time, datasheet and calibrated models
                           (step_time_accuracy: the whole step, in the summary's table)

and docs/results.md is rewritten from the summary (every figure in it is this run's output; README
links it). `--only NAME ...` runs a subset (the page is then left alone).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PY = sys.executable

# (name, arguments, timeout seconds). Order: the cheap, deterministic ones first.
BENCHMARKS = [
    ("solver_scaling", ["benchmarks/solver_scaling.py"], 420),
    ("partition_quality", ["benchmarks/partition_quality.py"], 600),  # with the traced Llama-70B tp rows
    ("published_runs", ["benchmarks/published_runs.py", "--free", "--time-limit", "30"], 1200),  # Megatron's table
    ("trace_large", ["benchmarks/trace_large.py"], 180),
    ("compile_large", ["benchmarks/compile_large.py"], 240),
    ("cost_model_accuracy", ["benchmarks/cost_model_accuracy.py", "--json", "{tmp}/cost_model.json"], 720),
    ("step_time_accuracy", ["benchmarks/step_time_accuracy.py", "--json", "{tmp}/step_time.json"], 900),
    ("runtime_overhead", ["benchmarks/runtime_overhead.py"], 600),
    ("checkpoint_overhead", ["benchmarks/checkpoint_overhead.py"], 300),
    ("crash_consistency", ["benchmarks/crash_consistency.py"], 300),
    ("memory_tier", ["benchmarks/memory_tier.py"], 600),
    ("elastic_recovery", ["benchmarks/elastic_recovery.py"], 900),
    ("canary_exclusion", ["benchmarks/canary_exclusion.py"], 900),
    ("recompute", ["benchmarks/recompute.py"], 600),
    ("precision", ["benchmarks/precision.py"], 600),
    ("tensor_parallel", ["benchmarks/tensor_parallel.py"], 600),
    ("data_loading", ["benchmarks/data_loading.py"], 300),
    ("compiled_stages", ["benchmarks/compiled_stages.py"], 1500),  # inductor compiles: minutes here
    ("screenshot_report", ["benchmarks/screenshot_report.py"], 120),
    ("zero_bubble", ["benchmarks/zero_bubble.py", "--scale", "--time-limit", "30"], 1200),  # 1f1b vs zb vs zbv
]
TAIL_LINES = 14
WHOLE_OUTPUT = ("published_runs",)  # tables read as a whole: printed entire in the summary


def run_one(name: str, args: list[str], timeout_s: int, tmp: str) -> dict:
    command = [PY, *[a.format(tmp=tmp) for a in args]]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    started = time.perf_counter()
    print(f"[bench] {name}: {' '.join(command[1:])} (timeout {timeout_s} s)", flush=True)
    try:
        proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
        stdout, stderr, code = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        status, code = f"timeout after {timeout_s} s", None
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
    seconds = time.perf_counter() - started
    print(f"[bench] {name}: {status} in {seconds:.0f} s", flush=True)
    command_text = " ".join([".venv/bin/python", *args])
    for suffix in (" --json {tmp}/cost_model.json", " --json {tmp}/step_time.json"):
        command_text = command_text.replace(suffix, "")
    return {"name": name, "command": command_text,
            "status": status, "returncode": code, "seconds": seconds, "stdout": stdout, "stderr": stderr[-4000:]}


# ---- parsers of the benchmarks' printed tables ------------------------------------------------------

def parse_solver_scaling(stdout: str) -> list[dict]:
    rows = []
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) >= 6 and parts[0].isdigit() and parts[1].isdigit() and parts[2].isdigit():
            rows.append({"layers": int(parts[0]), "regions": int(parts[1]), "stages": int(parts[2]),
                         "status": parts[3], "solve_s": float(parts[4]),
                         "gap": float(parts[5].rstrip("%")) / 100 if parts[5].endswith("%") else None,
                         "step_s": float(parts[7]) if len(parts) > 7 else None})
    return rows


def parse_partition_quality(stdout: str) -> list[dict]:
    rows, title = [], None
    for line in stdout.splitlines():
        if ":" in line and "regions ->" in line:
            title = line.split(":")[0].strip()
            continue
        parts = line.split()
        # ours_s sublayer_s uniform_s param_bal_s lower_s uni/ours par/ours ours/lb sub/lb
        if title and len(parts) == 9 and re.fullmatch(r"[0-9.]+", parts[0]):
            def num(text):
                try:
                    return float(text.rstrip("*"))
                except ValueError:
                    return None
            rows.append({"scenario": title, "ours_s": num(parts[0]), "sublayer_s": num(parts[1]),
                         "uniform_s": num(parts[2]), "param_balanced_s": num(parts[3]),
                         "lower_bound_s": num(parts[4]), "sublayer_over_lb": num(parts[8]),
                         "uniform_fits": not parts[2].endswith("*"),
                         "param_balanced_fits": not parts[3].endswith("*")})
            title = None
    return rows


# ---- plots ----------------------------------------------------------------------------------------

def plots(results: dict) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[bench] matplotlib is not installed: no plots (pip install -c constraints.txt -e '.[test]')")
        return []
    made = []
    scaling = results.get("solver_scaling_table") or []
    if scaling:
        fig, ax = plt.subplots(figsize=(6, 4))
        for stages in sorted({r["stages"] for r in scaling}):
            pts = sorted((r["regions"], r["solve_s"]) for r in scaling if r["stages"] == stages)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{stages} stages")
        ax.axhline(10, color="grey", linestyle="--", linewidth=1, label="target 10 s")
        ax.set_xlabel("regions (GPT-like, 2 per layer + 2)")
        ax.set_ylabel("solve time, s (2 cores)")
        ax.set_title("ILP solve time vs problem size")
        ax.legend()
        fig.tight_layout()
        fig.savefig(RESULTS / "solver_time.png", dpi=110)
        plt.close(fig)
        made.append("solver_time.png")
    quality = results.get("partition_quality_table") or []
    if quality:
        fig, ax = plt.subplots(figsize=(7, 4))
        names = ("ours_s", "uniform_s", "param_balanced_s", "lower_bound_s")
        width = 0.2
        for k, key in enumerate(names):
            values = [(r[key] or 0) / r["ours_s"] for r in quality]
            ax.bar([i + (k - 1.5) * width for i in range(len(quality))], values, width,
                   label=key.replace("_s", "").replace("_", " "))
        ax.set_xticks(range(len(quality)))
        ax.set_xticklabels([r["scenario"].split(",")[0][:28] for r in quality], fontsize=7, rotation=10)
        ax.set_ylabel("predicted step time / ours")
        ax.set_title("Plan quality vs baselines (same cost model)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(RESULTS / "plan_quality.png", dpi=110)
        plt.close(fig)
        made.append("plan_quality.png")
    cost = results.get("cost_model") or {}
    rows = cost.get("configs") or []
    if rows:
        fig, axes = plt.subplots(1, 2, figsize=(9, 4))
        markers = {"gpt": "o", "hf-gpt2": "s", "hf-llama": "^"}
        top = max(max(r["measured_s"], *r["predicted_s"].values()) for r in rows) * 1e3 * 1.1
        for ax, which in zip(axes, ("datasheet", "calibrated")):
            for model in sorted({r["model"] for r in rows}):
                mine = [r for r in rows if r["model"] == model]
                ax.scatter([r["measured_s"] * 1e3 for r in mine], [r["predicted_s"][which] * 1e3 for r in mine],
                           marker=markers.get(model, "o"), label=model)
            ax.plot([0, top], [0, top], color="grey", linewidth=1)
            ax.fill_between([0, top], [0, top * 0.9], [0, top * 1.1], color="grey", alpha=0.15, label="±10%")
            err = cost["summary"]["all"][f"time_{which}"]
            ax.set_title(f"{which}: median error {err['median']:.1%}")
            ax.set_xlabel("measured stage fwd+bwd, ms")
            ax.set_ylabel("predicted, ms")
            ax.set_xlim(0, top)
            ax.set_ylim(0, top)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(RESULTS / "cost_model.png", dpi=110)
        plt.close(fig)
        made.append("cost_model.png")
    return made


# ---- summary --------------------------------------------------------------------------------------

def _pct(entry) -> str:
    return f"{entry['median']:.1%} / {entry['worst']:.1%}" if entry else "-"


def summary_markdown(results: dict, images: list[str], image_prefix: str) -> str:
    meta = results["meta"]
    lines = [
        f"Produced by `make bench` (`.venv/bin/python benchmarks/run_all.py`) on {meta['date']}: "
        f"{meta['cpus']} CPU cores ({meta['machine']}), load average {meta['load_before']} before and "
        f"{meta['load_after']} after; the machine was shared, so times are medians over repeats and "
        f"upper bounds. The whole run took {meta['total_s'] / 60:.1f} min. Raw output: "
        "`benchmarks/results/results.json`.",
        *[f"Rerun on {r['date']} (`benchmarks/run_all.py --only {' '.join(r['names'])} --merge`, load average "
          f"{r['load_before']} before and {r['load_after']} after, {r['total_s'] / 60:.1f} min): {', '.join(r['names'])}."
          for r in meta.get("reruns", [])],
        "",
        "| benchmark | status | seconds | command |",
        "|---|---|---|---|",
    ]
    for b in results["benchmarks"]:
        lines.append(f"| {b['name']} | {b['status']} | {b['seconds']:.0f} | `{b['command']}` |")
    cost = results.get("cost_model")
    if cost:
        lines += ["", "**Cost model accuracy** (per-stage forward+backward time of one microbatch and per-rank "
                  "peak memory, predicted vs measured; median / worst relative error over the stages of 2- and "
                  "4-stage plans; `benchmarks/cost_model_accuracy.py` states the methods). \"calibrated\" is "
                  "the profile `partitioner compile MODEL --calibrate --profile-out cpu.profile.json` fits "
                  "here (reuse it with `--profile cpu.profile.json`):", "",
                  "| model | stages measured | time, datasheet model | time, calibrated | time, profile fitted on GPT "
                  "| peak memory |", "|---|---|---|---|---|---|"]
        for model, e in cost["summary"].items():
            lines.append(f"| {model} | {e['peak_memory']['n']} | {_pct(e.get('time_datasheet'))} | "
                         f"{_pct(e.get('time_calibrated'))} | {_pct(e.get('time_calibrated_on_gpt'))} | "
                         f"{_pct(e['peak_memory'])} |")
        mem = cost.get("memory_summary")
        if mem:
            lines += ["", f"Peak memory, predicted / measured per stage over {mem['n']} stages (the plans above and "
                      "the memory-binding cases: recompute under a tight capacity, a 16384-token vocabulary): "
                      f"min {mem['min_ratio']:.3f}, median {mem['median_ratio']:.3f}, max {mem['max_ratio']:.3f} "
                      "(targets: min >= 0.97, median <= 1.10; docs/design.md §12: never under-predict)."]
    step = results.get("step_time")
    if step:
        lines += ["", "**Whole step, predicted vs measured** (the number the solver minimises; plans trained under "
                  "torchrun, median step time, fastest of the rounds; both models include core sharing and the "
                  "per-microbatch stage overhead; `benchmarks/step_time_accuracy.py` states the methods):", "",
                  "| plan | ranks | microbatches x size | core-sharing factor | measured ms | datasheet ms | error "
                  "| calibrated ms | error |", "|---|---|---|---|---|---|---|---|---|"]
        for e in step["plans"]:
            lines.append(f"| {e['name']} | {e['world']} | {e['microbatches']} x {e['microbatch_size']} | "
                         f"{e['core_sharing']:.2f} | {e['measured_s'] * 1e3:.1f} | "
                         f"{e['predicted_s']['datasheet'] * 1e3:.1f} | {e['error']['datasheet']:.1%} | "
                         f"{e['predicted_s']['calibrated'] * 1e3:.1f} | {e['error']['calibrated']:.1%} |")
        summ = step["summary"]
        lines.append(f"| median error | | | | | | {summ['datasheet']['median']:.1%} | | "
                     f"{summ['calibrated']['median']:.1%} |")
    scaling = results.get("solver_scaling_table")
    if scaling:
        lines += ["", "**Solver scaling** (GPT-like, width 4096, 16 H100, 32 microbatches, 1F1B):", "",
                  "| layers | regions | stages | status | solve s | gap |", "|---|---|---|---|---|---|"]
        for r in scaling:
            gap = f"{r['gap']:.2%}" if r["gap"] is not None else "-"
            lines.append(f"| {r['layers']} | {r['regions']} | {r['stages']} | {r['status']} | {r['solve_s']:.2f} | {gap} |")
    quality = results.get("partition_quality_table")
    if quality:
        lines += ["", "**Plan quality** (predicted step time, same cost model; ours at op granularity, a region "
                  "per matmul; each baseline at its own best stages x dp x microbatches x recompute, - = fits no "
                  "configuration; lower bound = perfectly divisible work + forced recompute + all-reduce, the "
                  "smallest over every allowed candidate):",
                  "", "| scenario | ours s | ours / lower bound | uniform s | param-balanced s | lower bound s | "
                  "uniform / ours | sublayer granularity / its bound |", "|---|---|---|---|---|---|---|---|"]
        for r in quality:
            def cell(key, fits=True):
                return "-" if r[key] is None else f"{r[key]:.4f}{'' if fits else '*'}"
            ratio = f"{r['uniform_s'] / r['ours_s']:.2f}x" if r["uniform_s"] else "-"
            sub = "-" if r.get("sublayer_over_lb") is None else f"{r['sublayer_over_lb']:.3f}"
            lines.append(f"| {r['scenario']} | {cell('ours_s')} | {r['ours_s'] / r['lower_bound_s']:.3f} | "
                         f"{cell('uniform_s', r['uniform_fits'])} | {cell('param_balanced_s', r['param_balanced_fits'])} "
                         f"| {cell('lower_bound_s')} | {ratio} | {sub} |")
    if images:
        lines += [""] + [f"![{img[:-4]}]({image_prefix}{img})" for img in images]
    lines += ["", "Closing lines of every benchmark's output, verbatim:"]
    for b in results["benchmarks"]:
        tail = [line for line in b["stdout"].rstrip().splitlines() if line.strip()]
        tail = tail if b["name"] in WHOLE_OUTPUT else tail[-TAIL_LINES:]
        if not tail and b["stderr"].strip():
            tail = b["stderr"].rstrip().splitlines()[-4:]
        lines += ["", f"`{b['command']}` ({b['status']}, {b['seconds']:.0f} s):", "", "```", *tail, "```"]
    return "\n".join(lines) + "\n"


RESULTS_PAGE = ROOT / "docs" / "results.md"
KEPT = "Correctness is what the tests assert"  # that paragraph is no measurement of this run: kept


def update_results_page(section: str, page: Path = RESULTS_PAGE) -> None:
    """``page`` rewritten: its title, the paragraph on what the tests assert, then ``section``."""
    old = page.read_text() if page.is_file() else ""
    keep = old[old.index(KEPT):].split("\n\n", 1)[0].rstrip() + "\n\n" if KEPT in old else ""
    page.write_text("# Results\n\n" + keep + section)


def write_outputs(results: dict, *, page: bool) -> list[str]:
    images = plots(results)
    (RESULTS / "summary.md").write_text("# Benchmark results\n\n" + summary_markdown(results, images, ""))
    if page:  # docs/results.md links the plots from docs/
        update_results_page(summary_markdown(results, images, "../benchmarks/results/"))
    return images


def merge_into_previous(rerun: dict, previous: dict) -> dict:
    """``previous`` with the benchmarks of ``rerun`` replaced (records and parsed tables); its meta
    keeps the full run's figures and lists the reruns with their own date and load."""
    names = {b["name"] for b in rerun["benchmarks"]}
    merged = dict(previous)
    merged["benchmarks"] = [next((r for r in rerun["benchmarks"] if r["name"] == b["name"]), b)
                            for b in previous["benchmarks"]]
    merged["benchmarks"] += [b for b in rerun["benchmarks"] if b["name"] not in {p["name"] for p in previous["benchmarks"]}]
    for key, value in rerun.items():
        if key not in ("benchmarks", "meta"):
            merged[key] = value
    meta = dict(previous["meta"])
    meta["reruns"] = list(meta.get("reruns", [])) + [{"names": sorted(names), **rerun["meta"]}]
    merged["meta"] = meta
    return merged


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="run only these benchmarks (docs/results.md left alone)")
    parser.add_argument("--merge", action="store_true", help="with --only: replace these benchmarks' records in "
                        "the existing results.json, keep the others, and rewrite the summary and docs/results.md (the "
                        "header then says which benchmarks were rerun, and when)")
    parser.add_argument("--render", action="store_true", help="run nothing: redraw the summary, plots and "
                        "docs/results.md from benchmarks/results/results.json")
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.render:
        results = json.loads((RESULTS / "results.json").read_text())
        write_outputs(results, page=True)
        return 0
    chosen = [b for b in BENCHMARKS if not args.only or b[0] in args.only]
    started = time.perf_counter()
    load_before = " ".join(f"{x:.1f}" for x in os.getloadavg())
    results: dict = {"benchmarks": []}
    with tempfile.TemporaryDirectory() as tmp:
        for name, bench_args, timeout_s in chosen:
            record = run_one(name, bench_args, timeout_s, tmp)
            results["benchmarks"].append(record)
            if name == "solver_scaling":
                results["solver_scaling_table"] = parse_solver_scaling(record["stdout"])
            elif name == "partition_quality":
                results["partition_quality_table"] = parse_partition_quality(record["stdout"])
            elif name == "cost_model_accuracy" and Path(tmp, "cost_model.json").is_file():
                results["cost_model"] = json.loads(Path(tmp, "cost_model.json").read_text())
            elif name == "step_time_accuracy" and Path(tmp, "step_time.json").is_file():
                results["step_time"] = json.loads(Path(tmp, "step_time.json").read_text())
    results["meta"] = {"date": datetime.date.today().isoformat(), "cpus": os.cpu_count(),
                       "machine": platform.machine(), "python": platform.python_version(),
                       "load_before": load_before, "load_after": " ".join(f"{x:.1f}" for x in os.getloadavg()),
                       "total_s": time.perf_counter() - started}
    if args.merge and args.only:
        results = merge_into_previous(results, json.loads((RESULTS / "results.json").read_text()))
    (RESULTS / "results.json").write_text(json.dumps(results, indent=1, default=float) + "\n")
    images = write_outputs(results, page=not args.only or args.merge)
    failed = [b["name"] for b in results["benchmarks"] if b["status"] != "ok"]
    print(f"[bench] {len(chosen)} benchmarks in {(time.perf_counter() - started) / 60:.1f} min; wrote "
          f"{RESULTS.relative_to(ROOT)}/results.json, summary.md, {', '.join(images) or 'no plots'}"
          + (f"; not ok: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
