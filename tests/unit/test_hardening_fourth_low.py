"""Issue 42 finding 7, the Low items of the fourth hardening round: hand-edited corpus files, input
lines and a full disk in `data prepare`, an empty corpus, the scratch folders a killed `data
prepare` or `export` leaves (Note [abandoned scratch folders] in runtime/scratch.py), a plan.json
without its program under `inspect --checkpoints` and a rank's last line. Each is one line naming
the file or value and the fix. The flag values (--host-timeout inf, --fail-host 1:-3:permanent,
generate's --temperature 1e-45, --seed 2**64, --device meta, a non-UTF-8 --prompt, replan -o a
file) are rows of test_hardening_low.py's BAD_FLAGS, which shares its compiled program."""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from _checkpoint_helpers import two_checkpoints, two_rank  # noqa: F401 - two_rank is a fixture
from partitioner.cli.commands import main as cli
from runtime import scratch
from runtime.data.corpus import CorpusError, CorpusSpec, open_source
from runtime.data.corpus.prepare import _SplitWriter, prepare
from runtime.errors import is_no_space
from runtime.launch.rank import rank_error_lines
from tests.unit.test_hardening_low import _one_error_line

REPO = Path(__file__).resolve().parents[2]


def _run(argv, capsys) -> tuple[int, str]:
    rc = cli([str(a) for a in argv])
    return rc, capsys.readouterr().err


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    (root / "a.txt").write_text("hello world, a corpus to read\n" * 4)
    prepare([str(root / "a.txt")], str(root / "c"), tokenizer="bytes")
    return root / "c"


def _word_level(folder: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers  # lazy: only the tokenizer cases need it

    folder.mkdir()
    tokenizer = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2, "<|endoftext|>": 3},
                                           unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


# ---- meta.json ---------------------------------------------------------------------------------

def _drop_file(meta):
    del meta["splits"]["train"]["file"]


META_EDITS = {  # a hand-edited meta.json: (edit, what the line names)
    "no splits": (lambda m: m.pop("splits"), "it has no splits"),
    "splits a list": (lambda m: m.update(splits=["train.bin"]), 'splits ["train.bin"] is not an object'),
    "a split without file": (_drop_file, "splits.train.file is null, not a file name"),
    "vocab_size -5": (lambda m: m.update(vocab_size=-5), "vocab_size -5 is not a whole number of tokens >= 1"),
    "vocab_size lots": (lambda m: m.update(vocab_size="lots"), 'vocab_size "lots" is not a whole number'),
}


@pytest.mark.parametrize("case", sorted(META_EDITS))
def test_a_malformed_meta_json_is_one_line_naming_it(corpus, tmp_path, capsys, case):
    edit, says = META_EDITS[case]
    folder = tmp_path / "c"
    shutil.copytree(corpus, folder)
    meta = json.loads((folder / "meta.json").read_text())
    edit(meta)
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CorpusError) as err:  # what a rank, compile and generate open it with
        open_source(CorpusSpec.parse(f"tokens:{folder}"))
    assert says in str(err.value)
    rc, err_text = _run(["data", "check", f"tokens:{folder}"], capsys)  # was a KeyError traceback, or "ok, vocab -5"
    line = _one_error_line(err_text)
    assert rc != 0 and str(folder / "meta.json") in line and says in line and "prepare the corpus again" in line, line


# ---- the tokenizer's config, JSONL lines, text files -------------------------------------------

@pytest.mark.parametrize("body, says", [(b"[1, 2]", "a JSON list, not an object"), (b"{not json", "not JSON"),
                                        (b"\xff\xfe{}", "not JSON")])
def test_a_tokenizer_config_that_is_no_object_is_one_line(tmp_path, capsys, body, says):
    tok = _word_level(tmp_path / "tok")
    (tok / "tokenizer_config.json").write_bytes(body)
    (tmp_path / "a.txt").write_text("hello world\n")
    rc, err = _run(["data", "prepare", tmp_path / "a.txt", "-o", tmp_path / "c", "--tokenizer", tok, "-q"], capsys)
    line = _one_error_line(err)  # a list was an AttributeError traceback; not JSON named no file
    assert rc != 0 and str(tok / "tokenizer_config.json") in line and says in line and "fix or remove it" in line, line
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "tok"]


@pytest.mark.parametrize("line_bytes, says", [
    (b'{"text": "caf\xe9"}\n', "docs.jsonl:2: not UTF-8 (byte 0xe9 at column 14)"),
    (b"[" * 100_000 + b"]" * 100_000 + b"\n", "docs.jsonl:2: nested deeper than the JSON reader goes"),
])
def test_a_jsonl_line_not_utf8_or_nested_too_deep_is_one_line(tmp_path, capsys, line_bytes, says):
    path = tmp_path / "docs.jsonl"
    path.write_bytes(b'{"text": "fine"}\n' + line_bytes)
    rc, err = _run(["data", "prepare", path, "-o", tmp_path / "c", "--tokenizer", "bytes", "-q"], capsys)
    line = _one_error_line(err)  # was the codec's or the recursion's message, naming no file
    assert rc != 0 and says in line, line
    assert sorted(os.listdir(tmp_path)) == ["docs.jsonl"]


def test_a_text_file_not_utf8_for_a_text_tokenizer_is_one_line(tmp_path, capsys):
    tok = _word_level(tmp_path / "tok")
    (tmp_path / "a.txt").write_bytes(b"hello \xff world\n")
    rc, err = _run(["data", "prepare", tmp_path / "a.txt", "-o", tmp_path / "c", "--tokenizer", tok, "-q"], capsys)
    line = _one_error_line(err)
    assert rc != 0 and f"{tmp_path / 'a.txt'}: not UTF-8 (byte 0xff at offset 6)" in line and "iconv" in line, line
    rc, _ = _run(["data", "prepare", tmp_path / "a.txt", "-o", tmp_path / "c", "--tokenizer", "bytes", "-q"], capsys)
    assert rc == 0  # bytes take any byte


@pytest.mark.parametrize("name, content", [("empty.txt", b""), ("blank.jsonl", b'\n{"text": ""}\n')])
def test_an_empty_corpus_is_refused(tmp_path, capsys, name, content):
    (tmp_path / name).write_bytes(content)
    rc, err = _run(["data", "prepare", tmp_path / name, "-o", tmp_path / "c", "--tokenizer", "bytes", "-q"], capsys)
    line = _one_error_line(err)  # was "0 train tokens ... train on it: --data tokens:c"
    assert rc != 0 and f"{tmp_path / name}: the inputs hold no text (0 tokens)" in line, line
    assert sorted(os.listdir(tmp_path)) == [name]


# ---- a full disk --------------------------------------------------------------------------------

def _prepare_with_limit(tmp_path: Path, out: Path, wrap: list[str]) -> subprocess.CompletedProcess:
    def limit():  # the kernel refuses writes past 64 KiB (Python ignores SIGXFSZ: write() says EFBIG)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([*wrap, sys.executable, "-m", "partitioner.cli", "data", "prepare", str(tmp_path / "big.txt"),
                           "-o", str(out), "--tokenizer", "bytes", "-q"], env=env, capture_output=True, text=True,
                          timeout=120, preexec_fn=None if wrap else limit)


def _userns_forbidden() -> str | None:
    """Why this kernel gives no unprivileged user namespace (so no private tmpfs mount), or None."""
    for knob in ("/proc/sys/user/max_user_namespaces", "/proc/sys/kernel/unprivileged_userns_clone"):
        try:
            if Path(knob).read_text().strip() == "0":
                return f"{knob} is 0"
        except OSError:
            continue
    return None if shutil.which("unshare") else "no unshare command"


def _tiny_tmpfs(where: Path) -> list[str]:
    """A command prefix that runs the rest in a mount namespace with a 64 KiB tmpfs at ``where``.
    Skips only where the kernel forbids user namespaces; anywhere else a refused unshare fails."""
    shell = f"mount -t tmpfs -o size=64k tmpfs {where} && exec \"$@\""
    wrap = ["unshare", "-Urm", "sh", "-c", shell, "sh"]
    if (why := _userns_forbidden()) is not None:
        pytest.skip(f"no private tmpfs can be mounted here ({why}); test_a_full_device_is_no_space and the "
                    "ulimit case still run")
    done = subprocess.run([*wrap, "true"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, f"user namespaces are allowed here, yet the tmpfs mount failed: {done.stderr}"
    return wrap


@pytest.mark.parametrize("how", ["ulimit -f", "a 64 KiB tmpfs"])
def test_a_full_disk_during_prepare_is_one_line_and_leaves_nothing(tmp_path, how):
    (tmp_path / "big.txt").write_text("hello world " * 20_000)  # 240 KB of text: 480 KB of uint16 tokens
    disk = tmp_path / "disk"
    disk.mkdir()
    wrap = [] if how == "ulimit -f" else _tiny_tmpfs(disk)
    out = disk / "corpus"
    done = _prepare_with_limit(tmp_path, out, wrap)
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    why = "File too large" if how == "ulimit -f" else "No space left on device"
    assert lines[0].startswith(f"error: -o {out}: {why} writing the corpus in {disk}"), lines[0]
    assert "free space there" in lines[0] and "Errno" not in lines[0], lines[0]
    assert os.listdir(disk) == []  # no corpus, no .partial folder


def test_a_full_device_is_no_space():
    """The kernel's own ENOSPC (/dev/full: every write fails with it), where no tmpfs can be
    mounted: the split writer lets it through as the OSError prepare turns into its one line."""
    writer = _SplitWriter("/dev/full", "uint16")
    with pytest.raises(OSError) as caught:
        writer.write(np.arange(100_000) % 256, documents=1, origin="big.txt")
        writer.close()
    assert caught.value.errno == errno.ENOSPC and is_no_space(caught.value)


# ---- abandoned scratch folders ------------------------------------------------------------------

def _abandoned(parent: Path, prefix: str) -> Path:
    """A scratch folder as a SIGKILLed maker leaves it: made and locked by a process now dead, and
    older than SWEEP_AGE_S."""
    code = ("import sys, os, signal; from runtime import scratch; "
            "path, _ = scratch.make_scratch(sys.argv[1], sys.argv[2]); open(os.path.join(path, 'train.bin'), 'wb')"
            ".write(bytes(1000)); print(path, flush=True); os.kill(os.getpid(), signal.SIGKILL)")
    done = subprocess.run([sys.executable, "-c", code, str(parent), prefix], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    path = Path(done.stdout.strip())
    assert done.returncode == -9 and path.is_dir(), done.stderr
    old = time.time() - 2 * scratch.SWEEP_AGE_S
    os.utime(path, (old, old))
    return path


def test_a_killed_prepares_partial_folder_is_swept_by_the_next(tmp_path, corpus):
    dead = _abandoned(tmp_path, ".c.partial-")
    held, lock = scratch.make_scratch(str(tmp_path), ".c.partial-")  # a live prepare's: locked
    os.utime(held, (time.time() - 100, time.time() - 100))
    young = tmp_path / ".c.partial-young"  # unlocked but just made: its maker may not have locked it yet
    young.mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / ".c.partial-link")  # never followed, never removed
    try:
        prepare([str(corpus.parent / "a.txt")], str(tmp_path / "c"), tokenizer="bytes")
        names = sorted(os.listdir(tmp_path))
    finally:
        scratch.release(lock)
    assert not dead.exists(), names
    assert names == sorted(["c", Path(held).name, ".c.partial-young", ".c.partial-link"]), names
    swept = scratch.sweep_abandoned(str(tmp_path), ".c.partial-", older_than_s=0)
    assert sorted(swept) == sorted([held, str(young)])  # released: the next maker sweeps it


def test_a_killed_exports_tmp_folder_is_swept_by_the_next(two_rank, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    two_checkpoints(two_rank, ckpt)
    dead = _abandoned(tmp_path, ".weights.tmp-")
    older = tmp_path / ".weights.tmp-4242"  # an older version's, named by its pid
    older.mkdir()
    os.utime(older, (time.time() - 100, time.time() - 100))
    assert cli(["export", ckpt, "--program", two_rank, "-o", str(tmp_path / "weights")]) == 0
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "weights"]
    assert not dead.exists()


# ---- inspect --checkpoints ---------------------------------------------------------------------

@pytest.mark.parametrize("body, says", [("{}", 'has no "program" object'), ("[1]", 'has no "program" object'),
                                        ('{"program": {"world_size": 2}}', "the program object lacks")])
def test_inspect_checkpoints_of_a_plan_without_its_program_is_one_line(tmp_path, capsys, body, says):
    (tmp_path / "plan.json").write_text(body)
    (tmp_path / "checkpoints").mkdir()
    rc, err = _run(["inspect", tmp_path, "--checkpoints"], capsys)
    line = _one_error_line(err)  # was KeyError: 'program'
    assert rc != 0 and str(tmp_path / "plan.json") in line and says in line and "partitioner compile" in line, line


# ---- a rank's last line -------------------------------------------------------------------------

def test_a_rank_error_whose_message_starts_with_a_newline_says_it():
    exc = RuntimeError("\n  index 70 is out of bounds for dimension 0 with size 64\nmore detail")
    told = rank_error_lines(1, exc, whole=False)  # a traceback above holds the whole message
    assert told == "[rank 1] RuntimeError: index 70 is out of bounds for dimension 0 with size 64", told
    whole = rank_error_lines(1, exc, whole=True)  # no traceback: the other lines follow
    assert whole.splitlines() == [told, "more detail"], whole
    assert rank_error_lines(0, ValueError("   "), whole=True) == "[rank 0] ValueError: (no message)"
