"""benchmarks/gpu_check.py, the one-GPU check, as its dry run on CPU under gloo (so it cannot rot
between the rare runs on a GPU): tiny folders prepared on the meta device, moved elsewhere (as they
travel to the GPU machine), and every phase run; the report has every phase, and every run in it
trained, resumed to the same losses and reported predicted against measured figures. Plus the
report's survival rules (Note [a report that survives]): a phase past its limit is recorded as a
timeout, a spent budget skips what is left, and the report is written either way."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from benchmarks import gpu_check

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


def _check(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_dry_run_runs_every_phase_from_folders_that_travelled(tmp_path):
    corpus = tmp_path / "corpus_at"
    _check("prepare", "--out", str(tmp_path / "prepared"), "--dry-run", "--corpus-at", str(corpus), timeout=300)
    carried = tmp_path / "carried"
    (tmp_path / "prepared").rename(carried)  # another absolute path, as on the GPU machine
    shutil.rmtree(corpus)  # there, only the copy the folders carry exists: run puts it back
    out = tmp_path / "report" / "gpu_check.json"
    done = _check("run", "--folders", str(carried), "--out", str(out), "--dry-run", "--work", str(tmp_path / "work"),
                  "--budget", "1500", timeout=1600)
    report = json.loads(out.read_text())
    phases = report["phases"]
    assert list(phases) == ["P0", "P1", "P2", "P3", "P4", "P5", "P7", "P6"]
    for key in ("P0", "P1", "P2", "P3", "P4", "P5", "P6", "P7"):
        assert phases[key]["status"] == "ok", (key, phases[key]["error"], phases[key].get("output_tail"))

    env = phases["P0"]["result"]
    assert env["pinned"]["torch"] and env["torch"]
    assert env["imports_without_ortools"]["runtime.launch.rank"] == "ok"
    probes = phases["P1"]["result"]
    assert set(probes["gloo_collectives_on_device"]["rank_0"].values()) == {"ok"}
    assert probes["sdpa_backward_bitwise"] == {"default": True, "deterministic": True}
    assert probes["fused_adamw_cpu_step"]["same_update"] is True
    assert len(probes["keyed_draw"]["sha256_cpu"]) == 64

    runs = {run["name"]: run for p in phases.values() for run in (p["result"] or {}).get("runs", [])}
    trained = [run for run in runs.values() if not run.get("skipped")]
    assert len(trained) == 7, sorted(runs)
    for run in trained:
        assert run["ok"] and run["steps_logged"] >= 3, (run["name"], run["error"], run.get("output_tail"))
        assert run["predicted_step_time_s"] > 0 and run["measured_step_time_s"] > 0, run["name"]
        assert run["measured_peak_bytes"] > 0 and run["predicted_peak_bytes"] > 0, run["name"]
    assert runs["P4 hf_llama"]["skipped"]  # not prepared for the dry run: said, not failed

    p2 = phases["P2"]["result"]
    assert p2["resume_vs_uninterrupted"]["bitwise_equal"], p2["resume_vs_uninterrupted"]
    assert runs["P2 killed and resumed"]["faults"][0]["mode"] == "kill"
    assert runs["P2 eager bf16"]["val_losses"], "the eval pass wrote no val_loss"
    assert p2["generate"]["ok"] and p2["generate"]["new_tokens"] > 0, p2["generate"]
    p5 = phases["P5"]["result"]
    assert p5["resume_vs_P3"]["bitwise_equal"], p5["resume_vs_P3"]
    assert "tier=memory" in " ".join(runs["P5 memory tier + lossless, killed and resumed"]["recovered"])
    assert p5["export"]["ok"], p5["export"]
    for phase, folder in (("P4", "gpt_dropout"), ("P7", "gpt_dp2")):
        oracle = phases[phase]["result"][f"{folder}_oracle"]["cpu"]
        assert oracle["max_loss_diff"] < 1e-5 and oracle["max_param_diff"] < 1e-4, (folder, oracle)
    assert phases["P6"]["result"]["torch_compile_disabled"] is True
    assert len(report["summary"]) == len(runs)
    assert "P2 eager bf16: ok; step" in done.stdout


def _bare_folders(tmp_path: Path) -> Path:
    folders = tmp_path / "folders"
    (folders / "corpus").mkdir(parents=True)
    (folders / "corpus" / "meta.json").write_text("{}")
    (folders / "manifest.json").write_text(json.dumps(
        {"dry_run": True, "kind": "cpu", "corpus_at": str(tmp_path / "corpus_at"), "folders": {}}))
    return folders


def test_a_phase_past_its_limit_is_a_timeout_and_a_spent_budget_skips_the_rest(tmp_path):
    folders = _bare_folders(tmp_path)
    entry = gpu_check._phase("P0", folders, tmp_path, True, 0.5)  # P0 imports torch: longer than that
    assert entry["status"] == "timeout" and entry["error"].startswith("timed out after"), entry
    out = tmp_path / "report.json"
    report = gpu_check.run_check(folders, out, dry_run=True, work=tmp_path / "work", budget_s=0)
    assert [p["status"] for p in report["phases"].values()] == ["skipped"] * 8
    assert json.loads(out.read_text())["phases"]["P3"]["error"] == "the check's time budget is spent"


def test_prepare_replaces_only_a_folder_it_wrote(tmp_path):
    (tmp_path / "mine.txt").write_text("keep")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(SCRIPT), "prepare", "--out", str(tmp_path), "--dry-run"], env=env,
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].startswith(f"error: --out {tmp_path}: it "
                                                                                   "exists"), done.stderr
    assert (tmp_path / "mine.txt").read_text() == "keep"
