"""Issue 29, hardening third round, the Low items: export refuses a checkpoint whose shapes are not
the model's and never writes through a link; a step folder holding only its manifest is no
checkpoint to anything that asks (Note [a manifest alone is no checkpoint]); hostile weights files,
indexes, manifests, problems and cluster files get one line naming the file (Note [weights files are
checked first]); a full disk says which folder and what to do; bad values of the newer flags are
refused up front in one line; the shared-folder marker is never written through a link."""

from __future__ import annotations

import errno
import json
import os
import pathlib
import shutil
import struct

import pytest
import transformers

from _checkpoint_helpers import lie, rehash_manifest, two_checkpoints, two_rank  # noqa: F401 - two_rank is a fixture
from _runtime_folders import one_thread  # noqa: F401
from partitioner.cli.commands import main as cli
from partitioner.inspect import checkpoints as listing
from runtime.errors import DiskFullError, one_line_error
from runtime.program.spec import load_program
from runtime.resilience import checkpoint as ck
from runtime.resilience.checkpoint import durable
from runtime.resilience.checkpoint.shared import sees_marker, write_marker
from runtime.resilience.recovery import agree_newest, valid_for
from tests.drivers.checkpoint_drills import FakeTrainer, trainers_at


def _run(argv, capsys) -> tuple[int, str]:
    """The CLI in-process: (exit code, what it printed on stderr)."""
    rc = cli(argv)
    return rc, capsys.readouterr().err


def _one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def program_dir(tmp_path_factory):
    """One compiled 2-stage MLP program for every CLI case that needs a real plan."""
    out = str(tmp_path_factory.mktemp("prog") / "mlp")
    assert cli(["compile", "mlp", "--devices", "2", "--stages", "2", "-o", out, "-q"]) == 0
    return out


# ---- export -------------------------------------------------------------------------------------

def _shape(header, meta):
    key = next(k for k, v in sorted(header.items()) if k.startswith("param/") and len(v["shape"]) == 2
               and v["shape"][0] != v["shape"][1])
    header[key]["shape"] = header[key]["shape"][::-1]


def test_export_refuses_a_checkpoint_whose_shapes_are_not_the_models(two_rank, tmp_path, capsys):
    ckpt = str(tmp_path / "ckpt")
    two_checkpoints(two_rank, ckpt)
    lie(ckpt, 2, 0, _shape)  # the sha256 re-made: only the shape lies
    rc, err = _run(["export", ckpt, "--program", two_rank, "-o", str(tmp_path / "out")], capsys)
    line = _one_error_line(err)
    assert rc != 0 and "layers.0.weight" in line and "[8, 32]" in line and "[32, 8]" in line, line
    assert not (tmp_path / "out").exists()
    assert cli(["export", os.path.join(ckpt, ck.step_dirname(1)), "--program", two_rank, "-o",
                str(tmp_path / "older")]) == 0  # the step the error points to exports


def test_export_onto_a_dangling_link_is_refused_before_reading_anything(two_rank, tmp_path, capsys):
    ckpt = str(tmp_path / "ckpt")
    two_checkpoints(two_rank, ckpt)
    target = tmp_path / "elsewhere" / "weights"
    link = tmp_path / "out"
    os.symlink(target, link)
    rc, err = _run(["export", ckpt, "--program", two_rank, "-o", str(link)], capsys)
    line = _one_error_line(err)
    assert rc != 0 and "symbolic link" in line and str(link) in line and "Errno" not in line, line
    assert os.path.islink(link) and not (tmp_path / "elsewhere").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "out"]  # no temporary sibling


# ---- a manifest alone ---------------------------------------------------------------------------

def test_a_manifest_alone_is_no_checkpoint_to_run_inspect_or_resume(two_rank, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    program, _ = two_checkpoints(two_rank, ckpt)
    step_dir = os.path.join(ckpt, ck.step_dirname(2))
    for name in os.listdir(step_dir):
        if name != ck.MANIFEST:
            os.remove(os.path.join(step_dir, name))
    ck.read_manifest(ckpt, 2)  # the manifest itself is valid
    # run's --steps check, the memory tier's disk comparison and the restart line ask this
    assert ck.newest_committed(ckpt) == 1
    scan = listing.scan(ckpt, program=program)
    assert scan["resume"]["step"] == 1
    assert scan["checkpoints"][0]["status"] == "corrupt" and "missing" in scan["checkpoints"][0]["reason"]
    views = [valid_for(FakeTrainer(two_rank, rank, program), ckpt, warn=lambda _: None)[0]
             for rank in range(program.world_size)]
    assert views == [[1], [1]] and agree_newest(views) == 1


# ---- hostile files: one line naming the file ----------------------------------------------------

def _write(name: str, data: bytes):
    return lambda folder: (folder / name).write_bytes(data)


WEIGHTS = {
    "garbage": (_write("model.safetensors", bytes(range(256)) * 4), "model.safetensors"),
    "huge header": (_write("model.safetensors", struct.pack("<Q", 1 << 40) + b"{}"), "1099511627776"),
    "header over the cap": (_write("model.safetensors", struct.pack("<Q", 101 << 20) + b"{" + b" " * 64),
                            "100 MiB"),
    "empty": (_write("model.safetensors", b""), "too short"),
    "header not JSON": (_write("model.safetensors", struct.pack("<Q", 5) + b"{abc}"), "model.safetensors"),
    "weight_map a list": (_write("model.safetensors.index.json", json.dumps({"weight_map": ["a"]}).encode()),
                          "weight_map"),
    "weight_map out of the folder": (_write("model.safetensors.index.json", json.dumps(
        {"weight_map": {"transformer.wte.weight": "/etc/passwd"}}).encode()), "weight_map"),
    "index a list": (_write("model.safetensors.index.json", b"[1]"), "weight_map"),
    "a FIFO": (lambda folder: os.mkfifo(folder / "model.safetensors"), "FIFO"),
}


@pytest.fixture(scope="module")
def gpt2_config(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt2")
    transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8, bos_token_id=0,
                            eos_token_id=0).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("case", sorted(WEIGHTS))
def test_hostile_pretrained_weights_are_one_line(gpt2_config, tmp_path, capsys, case):
    make, expected = WEIGHTS[case]
    weights = tmp_path / "weights"
    weights.mkdir()
    make(weights)
    rc, err = _run(["compile", f"hf:{gpt2_config}", "--pretrained", str(weights), "-o", str(tmp_path / "out"), "-q"],
                   capsys)
    line = _one_error_line(err)
    assert rc != 0 and str(weights) in line and expected in line, line
    assert "SafetensorError" not in line and not (tmp_path / "out").exists()


def test_inspect_checkpoints_on_an_empty_manifest_says_why(two_rank, tmp_path, capsys):
    ckpt = str(tmp_path / "ckpt")
    two_checkpoints(two_rank, ckpt)
    with open(os.path.join(ckpt, ck.step_dirname(2), ck.MANIFEST), "w") as fh:
        fh.write("{}")
    rc, err = _run(["inspect", ckpt], capsys)
    assert rc == 0 and "Traceback" not in err
    scan = listing.scan(ckpt)
    assert scan["checkpoints"][0]["status"] == "corrupt" and "an empty object" in scan["checkpoints"][0]["reason"]
    assert "'manifest_sha256'" not in scan["checkpoints"][0]["reason"]  # was: a bare KeyError
    assert scan["resume"]["step"] == 1


@pytest.mark.parametrize("edit", ["problem a list", "regions a string", "assignment a list"])
def test_inspect_node_on_a_malformed_problem_is_one_line(program_dir, tmp_path, capsys, edit):
    folder = tmp_path / "prog"
    shutil.copytree(program_dir, folder)
    body = json.loads((folder / "plan.json").read_text())
    if edit == "problem a list":
        body["problem"] = []
    elif edit == "regions a string":
        body["problem"]["regions"] = "x"
    else:
        body["assignment"] = [1]
    (folder / "plan.json").write_text(json.dumps(body))
    rc, err = _run(["inspect", str(folder), "--node", "block.0"], capsys)
    line = _one_error_line(err)
    assert rc != 0 and "plan.json" in line and "recompile" in line, line


@pytest.mark.parametrize("flag", ["--cluster", "--job"])
def test_a_binary_cluster_or_job_file_is_named_in_its_error(tmp_path, capsys, flag):
    path = tmp_path / "file.toml"
    path.write_bytes(b"\xff\xfe\x00binary" * 16)
    rc, err = _run(["compile", "mlp", flag, str(path), "-o", str(tmp_path / "out"), "-q"], capsys)
    line = _one_error_line(err)
    assert rc != 0 and str(path) in line and "not text" in line and "codec" not in line, line


# ---- a full disk --------------------------------------------------------------------------------

def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_while_checkpointing_is_one_line_naming_the_folder(two_rank, tmp_path, monkeypatch):
    ckpt = str(tmp_path / "ckpt")
    program = load_program(two_rank)
    trainers = trainers_at(two_rank, 1)
    monkeypatch.setattr(durable.os, "write", _no_space)
    with pytest.raises(DiskFullError) as err:
        ck.commit_local(ckpt, [ck.snapshot(t) for t in trainers], program)
    monkeypatch.undo()
    text = str(err.value)
    step_dir = os.path.join(ckpt, ck.step_dirname(1))
    assert "\n" not in text and step_dir in text and "--checkpoint-dir" in text, text
    assert not [n for n in os.listdir(step_dir) if n.endswith(".tmp")]  # no debris
    # a rank prints it as its one line (runtime/launch/rank.py), however deep the persist wrapped it
    try:
        try:
            raise err.value
        except DiskFullError as inner:
            raise RuntimeError("rank 0: checkpoint persist failed") from inner
    except RuntimeError as wrapped:
        assert one_line_error(wrapped) is err.value


def test_a_full_disk_while_writing_the_program_folder_is_one_line(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setattr(pathlib.Path, "write_text", _no_space)
    rc, err = _run(["compile", "mlp", "-o", str(out), "-q"], capsys)
    monkeypatch.undo()
    line = _one_error_line(err)
    assert rc != 0 and str(out) in line and "No space left" in line and "-o DIR" in line, line
    assert list(tmp_path.iterdir()) == []  # nothing half-written left


# ---- bad values of the newer flags ---------------------------------------------------------------

BAD_FLAGS = [  # (argv; "P": the compiled program, "D": a scratch folder; run: 2 steps, were one let through), the line
    (["compile", "mlp", "-o", "D/o", "--data", ""], "has no kind"),
    (["compile", "mlp", "-o", "D/o", "--data", "bogus:x"], "is not one of"),
    (["compile", "mlp", "-o", "D/o", "--data", "tokens:x.bin,dtype=float99"], "not a token dtype"),
    (["compile", "mlp", "-o", "D/o", "--lr", "nan"], "finite"),
    (["compile", "mlp", "-o", "D/o", "--lr", "inf"], "finite"),
    (["compile", "mlp", "-o", "D/o", "--clip-grad-norm", "nan"], "finite"),
    (["compile", "mlp", "-o", "D/o", "--clip-grad-norm", "-1"], "must be > 0"),
    (["compile", "mlp", "-o", "D/o", "--steps", "0"], "total_steps"),
    (["compile", "mlp", "-o", "D/o", "--mtbf", "0s"], "more than 0"),
    (["compile", "mlp", "-o", "D/o", "--mtbf", "1.2.3h"], "not a duration"),
    (["compile", "mlp", "-o", "/proc/partitioner-test/o"], "cannot write a folder in /proc"),
    (["run", "P", "--steps", "2", "--eval-every", "5"], "no validation split"),
    (["run", "P", "--steps", "2", "--eval-every", "-1"], "--eval-every -1"),
    (["run", "P", "--steps", "2", "--eval-batches", "0"], "--eval-batches 0"),
    (["run", "P", "--steps", "2", "--eval-batches", "3"], "add --eval-every"),
    (["run", "P", "--steps", "2", "--checkpoint-full-every", "0"], "--checkpoint-full-every 0"),
    (["run", "P", "--steps", "2", "--checkpoint-full-every", "1000"], "at most 64"),
    (["run", "P", "--steps", "2", "--keep-checkpoints", "0"], "keep at least 1"),
    (["run", "P", "--steps", "2", "--collective-timeout", "nan"], "seconds > 0"),
    (["run", "P", "--steps", "2", "--mtbf", "0s"], "more than 0"),
    (["run", "P", "--steps", "2", "--mtbf", "-5h"], "--mtbf '-5h': the mean time between failures must be more than 0"),
    (["compile", "mlp", "-o", "D/o", "--mtbf", "-5h"], "more than 0"),
    (["run", "P", "--steps", "2", "--fail-at", "-1:3"], "--fail-at -1:3: rank -1 does not exist"),
    (["run", "P", "--steps", "2", "--fail-at", "one:3"], "--fail-at 'one:3': write RANK:STEP[:MODE]"),
    (["run", "P", "--steps", "2", "--fail-at", "0:1:boom"], "is not one of exit, kill, hang"),
    (["run", "P", "--steps", "2", "--fault-matmul", "x"], "--fault-matmul 'x': write RANK:STEP[:permanent]"),
    (["run", "P", "--steps", "2", "--fail-persist", "0:-1:5"], "--fail-persist '0:-1:5': write RANK:STEP:BYTES"),
    (["run", "P", "--steps", "2", "--memory-dir", "D"], "no memory tier would use it (the plan has no memory tier"),
    (["run", "P", "--steps", "2", "--memory-dir", "D", "--memory-tier", "off"], "(--memory-tier off)"),
    (["run", "P", "--steps", "2", "--run-dir", "/proc/partitioner-test"], "--run-dir /proc/partitioner-test"),
    (["run", "P", "--steps", "2", "--flip-bit", "0:1:no.such.tensor"], "holds no parameter"),
    (["run", "P", "--steps", "2", "--fail-host", "9:1"], "no rank runs on host 9"),
    (["run", "P", "--steps", "2", "--hosts", "0"], "each of the 2 ranks"),
    (["inspect", "P", "--html", "D"], "is a folder"),
    (["inspect", "P", "--html", "/proc/partitioner-test.html"], "cannot write in /proc"),
    (["export", "P", "-o", "D/e", "--program", "D/nowhere"], "--program D/nowhere: no plan.json"),
    (["generate", "P", "--prompt", "hi", "--device", "quantum"], "--device quantum"),
    (["generate", "P", "--prompt", "hi", "--temperature", "inf"], "--temperature inf"),
    # issue 42 finding 7: values that were accepted and then crashed, or did nothing
    (["run", "P", "--steps", "2", "--elastic", "--hosts", "0,1", "--host-timeout", "inf"],
     "--host-timeout inf: give seconds > 0 with --elastic, at most 86400"),
    (["run", "P", "--steps", "2", "--elastic", "--hosts", "0,1", "--fail-host", "1:-3:permanent"],
     "--fail-host '1:-3:permanent': host 1 step -3 is never reached"),
    (["run", "P", "--steps", "2", "--hosts", "0,1", "--fail-host", "1:2"], "--fail-host 1:2: step 2 is never reached"),
    (["generate", "P", "--prompt", "hi", "--temperature", "1e-45"], "--temperature 1e-45: under 1e-30"),
    (["generate", "P", "--prompt", "hi", "--seed", str(1 << 64)], f"--seed {1 << 64}: give a whole number from 0"),
    (["generate", "P", "--prompt", "hi", "--device", "meta"], "--device meta: meta tensors hold shapes and no values"),
    (["generate", "P", "--prompt", os.fsdecode(b"caf\xe9")], "--prompt: byte 0xe9 at character 4 is not UTF-8"),
    (["replan", "P", "--ranks", "0", "-o", "D/corpus.txt"], "-o D/corpus.txt: a file, not a folder"),
    (["data", "prepare", "D/corpus.txt", "-o", "/proc/partitioner-test", "--tokenizer", "bytes"],
     "cannot write a folder in /proc"),
]


@pytest.mark.parametrize("argv,says", BAD_FLAGS, ids=[" ".join(a[:1] + a[2:]).replace("--steps 2 ", "")[:60]
                                                      for a, _ in BAD_FLAGS])
def test_a_bad_flag_value_is_one_clear_line(program_dir, tmp_path, capsys, argv, says):
    (tmp_path / "corpus.txt").write_text("hello world " * 20)
    argv = [program_dir if a == "P" else str(tmp_path) if a == "D" else a.replace("D/", f"{tmp_path}/")
            for a in argv]
    says = says.replace("D/", f"{tmp_path}/")
    rc, err = _run(argv, capsys)
    line = _one_error_line(err)
    assert rc != 0 and says in line, line
    assert "Errno" not in line, line
    assert not os.path.exists(os.path.join(program_dir, "run", "metrics.jsonl"))  # no run started


# ---- the shared-folder marker ------------------------------------------------------------------

def test_the_shared_folder_marker_is_never_written_or_read_through_a_link(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's own file\n")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(mode=0o700)
    marker = ckpt / ".shared-check-abc"
    os.symlink(victim, marker)
    write_marker(str(marker), "abc")
    assert victim.read_text() == "the user's own file\n"
    assert not marker.is_symlink() and sees_marker(str(marker), "abc")
    marker.unlink()
    victim.write_text("abc")
    os.symlink(victim, marker)
    assert not sees_marker(str(marker), "abc")  # a link holding the token is not the marker


# ---- declared sizes ------------------------------------------------------------------------------

def test_a_manifest_declaring_a_huge_shard_is_not_read(program_dir, tmp_path):
    """The shard and its manifest agree on 1 GiB (sparse: nothing on disk), far more than the plan's
    stage memory allows (Note [declared sizes are bounded]); the resume falls back without reading it."""
    ckpt = str(tmp_path / "ckpt")
    program, _ = two_checkpoints(program_dir, ckpt)
    assert program.shard_bytes_bound is not None and program.shard_bytes_bound < 1 << 30
    path = os.path.join(ckpt, ck.step_dirname(2), ck.shard_filename(0))
    os.truncate(path, 1 << 30)

    def declare(manifest):
        next(e for e in manifest["shards"] if e["rank"] == 0)["bytes"] = 1 << 30
    rehash_manifest(ckpt, 2, declare)
    reads = ck.READS["shards"]
    warnings = []
    views = [valid_for(FakeTrainer(program_dir, rank, program), ckpt, warn=warnings.append)[0]
             for rank in range(program.world_size)]
    assert agree_newest(views) == 1 and views == [[1], [1]], views
    assert all("more than the" in w and str(1 << 30) in w for w in warnings), warnings
    assert ck.READS["shards"] - reads == program.world_size  # step 1's shard each rank needs; none of step 2
    entry = listing.scan(ckpt, program=program)["checkpoints"][0]
    assert entry["status"] == "corrupt" and "more than the" in entry["reason"]


@pytest.mark.parametrize("solver", [None, "a string"])
def test_run_on_a_plan_without_its_solver_record_is_one_line(program_dir, tmp_path, capsys, solver):
    """A hand-written plan.json without (or with a malformed) "solver" object: `run` says so in one
    line before torchrun (it was a KeyError traceback from Plan.load)."""
    folder = tmp_path / "hand"
    shutil.copytree(program_dir, folder)
    body = json.loads((folder / "plan.json").read_text())
    if solver is None:
        del body["solver"]
    else:
        body["solver"] = solver
    (folder / "plan.json").write_text(json.dumps(body))
    rc, err = _run(["run", str(folder), "--steps", "1"], capsys)
    assert rc != 0 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "'solver'" in err and "partitioner compile" in err


# ---- the launcher's last line after a canary's exclusion -----------------------------------------

def test_an_exclusion_the_elastic_launcher_said_is_not_called_a_re_plan(tmp_path, capsys):
    # an uncertain blame stops an elastic run with no re-plan: _exclude said so; no second, false line
    import time

    from runtime.resilience.canary_rules import EXIT_EXCLUDE, exit_code_after

    started = time.time() - 1
    (tmp_path / "exclude.json").write_text("{}")
    assert exit_code_after(str(tmp_path), 1, started, said=True) == EXIT_EXCLUDE
    assert capsys.readouterr().err == ""
    assert exit_code_after(str(tmp_path), 1, started) == EXIT_EXCLUDE  # torchrun's plain run: the line is true
    assert "stopped for a re-plan" in capsys.readouterr().err
    assert exit_code_after(str(tmp_path), 0, started) == 0  # the job finished: no exclusion stopped it
