"""`--recompute full|none` (Note [recompute a user pins] in partitioner/solver/recompute_cost.py),
through the CLI: a full-recompute program with dropout on 2 stages trains in the session's 2-rank
shared launch (Note [shared launches] in tests/_shared_launch.py) and verifies against the
one-process oracle; a pinned none on devices that would otherwise recompute is refused naming
the flag, or plans without recompute."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _shared_launch import Job, prepare
from partitioner.cli import main
from partitioner.cli.verify import check_run
from partitioner.models.builtin import load_workload

# dropout 0.1: the rerun must draw the first forward's masks (Note [recompute draws the same randomness])
MODEL = "gpt:layers=2,width=32,heads=2,vocab=64,seq=16,dropout=0.1"
# 680 KB devices: the 4-layer dropout GPT's stage 0 needs ~800 KB unless it recomputes (tests/e2e/test_recompute.py)
TIGHT_MODEL = "gpt:layers=4,width=32,heads=2,vocab=64,seq=16,dropout=0.1"
TIGHT_CLUSTER = '[[group]]\nkind = "cpu"\ncount = 2\nmemory_bytes = 680000\n'


def _compile(*args) -> int:
    return main(["compile", *map(str, args), "--no-calibrate", "-q", "--time-limit", "5"])


@prepare
def _full_recompute(root: Path):
    folder = root / "full"
    assert _compile(MODEL, "-o", folder, "--devices", 2, "--stages", 2, "--dp", 1, "--global-batch", 8,
                    "--microbatches", 2, "--recompute", "full") == 0
    return (root, folder), [Job(2, [folder, "--steps", "3", "--run-dir", root / "run"])]


@pytest.fixture(scope="module")
def full(shared_launches):
    return shared_launches.result(_full_recompute)[0]


def test_full_recompute_recomputes_every_region_trains_and_verifies(full, capsys):
    root, folder = full
    plan = json.loads((folder / "plan.json").read_text())
    assert plan["training"]["recompute"] == "full"
    assert plan["num_stages"] == 2
    # every region of this GPT saves memory by recompute (none updates a buffer): all pinned
    assert plan["regions"] and all(r["recompute"] for r in plan["regions"]), plan["regions"]
    for stage in range(2):
        text = (folder / f"stage_{stage}.py").read_text()
        for region in (r["name"] for r in plan["regions"] if r["stage"] == stage):
            assert f"checkpointed(self.recompute_{region.replace('.', '_')}," in text
    report = check_run(folder, root / "run", steps=3, workload=load_workload(MODEL))
    assert report.ok, report.text()
    assert report.oracle == "unpartitioned traced graph (keyed randomness)"  # the unpartitioned masks
    assert main(["inspect", str(folder)]) == 0
    assert "recompute full (pinned full): 4 of 4 regions recomputed" in capsys.readouterr().out


def test_recompute_none_where_memory_would_recompute_is_refused_naming_the_flag(tmp_path, capsys):
    cluster = tmp_path / "tight.toml"
    cluster.write_text(TIGHT_CLUSTER)
    common = ("--cluster", cluster, "--stages", 2, "--dp", 1, "--global-batch", 8, "--microbatches", 4)
    assert _compile(TIGHT_MODEL, "-o", tmp_path / "auto", *common) == 0
    chosen = json.loads((tmp_path / "auto" / "plan.json").read_text())
    assert any(r["recompute"] for r in chosen["regions"]), "the devices were meant to force recompute"
    capsys.readouterr()
    code = _compile(TIGHT_MODEL, "-o", tmp_path / "none", *common, "--recompute", "none")
    if code == 0:  # a plan without recompute that fits (other microbatches): then none is recomputed
        plan = json.loads((tmp_path / "none" / "plan.json").read_text())
        assert not any(r["recompute"] for r in plan["regions"]) and plan["training"]["recompute"] == "none"
        return
    err = capsys.readouterr().err.strip()
    assert code != 0 and "Traceback" not in err, err
    assert len(err.splitlines()) == 1 and "--recompute none" in err and "--recompute auto" in err, err
    assert not (tmp_path / "none").exists()  # no half-written folder
