"""`--recompute selective` (Note [selective recompute] in partitioner/solver/recompute_cost.py)
through the CLI: the built-in GPT with dropout on 2 stages, its attention written out (eager) and
as one SDPA call, each attention core under a checkpoint, trains in the session's 2-rank shared
launch (Note [shared launches] in tests/_shared_launch.py) and verifies against the one-process
oracle, whose dropout masks the reruns must redraw (Note [recompute draws the same randomness])."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _shared_launch import Job, prepare
from partitioner.cli import main
from partitioner.cli.verify import check_run
from partitioner.models.builtin import load_workload
from runtime.execute import randomness
from runtime.execute.stage import build_stage

MODELS = {"eager": "gpt:layers=2,width=32,heads=2,vocab=64,seq=16,dropout=0.1,attn=eager",
          "sdpa": "gpt:layers=2,width=32,heads=2,vocab=64,seq=16,dropout=0.1"}


@prepare
def _selective(root: Path):
    for name, model in MODELS.items():
        assert main(["compile", model, "-o", str(root / name), "--devices", "2", "--stages", "2", "--dp", "1",
                     "--global-batch", "8", "--microbatches", "2", "--recompute", "selective", "--no-calibrate",
                     "-q", "--time-limit", "5"]) == 0
    return root, [Job(2, [root / name, "--steps", "3", "--run-dir", root / f"run_{name}"]) for name in MODELS]


@pytest.fixture(scope="module")
def selective(shared_launches):
    return shared_launches.result(_selective)[0]


@pytest.mark.parametrize("name", list(MODELS))
def test_selective_recomputes_each_attention_core_trains_and_verifies(selective, name, capsys):
    folder = selective / name
    plan = json.loads((folder / "plan.json").read_text())
    assert plan["training"]["recompute"] == "selective" and plan["num_stages"] == 2
    assert not any(r["recompute"] for r in plan["regions"])  # no region whole
    blocks = [r for r in plan["regions"] if r["name"].startswith("block")]
    cores = plan["solver"]["attention_cores"]
    assert list(cores) == [r["name"] for r in blocks] and all(c["cores"] == 1 for c in cores.values())
    text = "".join((folder / f"stage_{s}.py").read_text() for s in range(2))
    for region in blocks:
        assert f"checkpointed(self.recompute_attention_{region['name'].replace('.', '_')}," in text
    report = check_run(folder, selective / f"run_{name}", steps=3, workload=load_workload(MODELS[name]))
    assert report.ok, report.text()
    assert report.oracle == "unpartitioned traced graph (keyed randomness)"  # the unpartitioned masks
    assert main(["inspect", str(folder)]) == 0
    assert "recompute selective (pinned): 2 attention core(s) recomputed, in 2 of" in capsys.readouterr().out


def _saved_bytes(stage, args) -> tuple[int, object]:
    """Bytes of the storages autograd saves in ``stage``'s forward, parameters aside."""
    params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = stage(*args)
    return sum(b for k, b in seen.items() if k not in params), out


def test_what_selective_saves_is_what_a_stage_stops_saving(selective, monkeypatch):
    """The eager program's stages run in this process with and without their cores' checkpoints:
    the bytes they stop saving are the plan's priced saving (within 2%, the fake run's rounding),
    and what they save is at most what the plan charges them."""
    folder = selective / "eager"
    plan = json.loads((folder / "plan.json").read_text())
    b = plan["microbatch_size"]
    args = (torch.randint(0, 64, (b, 16)),)
    randomness.set_context(seed=0, step=0, first_sample=0, microbatch=0)
    for s in range(2):
        stage = build_stage(str(folder), s).train()
        kept, out = _saved_bytes(stage, args)
        # the stage file's own name for it: called directly, as --recompute none runs the cores
        monkeypatch.setitem(type(stage).forward.__globals__, "checkpointed", lambda fn, *a: fn(*a))
        whole, _ = _saved_bytes(stage, args)
        monkeypatch.undo()
        regions = [r for r in plan["regions"] if r["stage"] == s]
        priced = sum(plan["solver"]["attention_cores"].get(r["name"], {}).get("saved_bytes_per_sample", 0)
                     for r in regions) * b
        assert priced > 0 and whole - kept == pytest.approx(priced, rel=0.02), (s, whole - kept, priced)
        assert kept <= sum(r["activation_bytes"] for r in regions) * b
        args = out if isinstance(out, tuple) else (out,)
