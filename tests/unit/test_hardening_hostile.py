"""Issue 29, hostile folders: the disk tier never follows a planted link (writing, reading or
pruning), refuses a checkpoint folder others can write in, and every read of a manifest, plan.json
or shard is bounded by type and size, a lossless delta's decompression by its declared size
(Note [files are not trusted] in runtime/file_trust.py); an hf: folder's own code never runs (Note
[no remote code]); pretrained weights of the wrong dtype kind are refused (Note [a stored dtype of
the right kind])."""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path
import stat
import threading
import tracemalloc

import pytest
import torch

from _checkpoint_helpers import two_stage_mlp_folder
from _runtime_folders import one_thread  # noqa: F401
from partitioner.cli import main
from partitioner.inspect import checkpoints as listing
from partitioner.models.builtin import load_workload
from runtime.errors import CheckpointCorruptError
from runtime.execute import pretrained
from runtime.file_trust import UntrustedFile, read_bounded
from runtime.program.spec import load_plan, load_program
from runtime.resilience import checkpoint as ck
from runtime.resilience.checkpoint.delta import decode_shard, encode_tensor
from runtime.resilience.recovery import _discard_newer
from tests.drivers.checkpoint_drills import trainers_at


@pytest.fixture(scope="module")
def two_rank(tmp_path_factory):
    return two_stage_mlp_folder(str(tmp_path_factory.mktemp("mlp2")),
                                model_fingerprint="mlp-8-32-32-32-4", plan_hash="plan-two-stages")


def _commit(folder: str, ckpt: str, steps: int, keep: int = 3) -> None:
    program = load_program(folder)
    trainers = trainers_at(folder, 1)
    for i in range(steps):
        if i:
            for t in trainers:
                t.fake_step(i)
        ck.commit_local(ckpt, [ck.snapshot(t) for t in trainers], program, keep=keep)


def _victim(tmp_path) -> tuple[str, bytes]:
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim.txt"
    victim.write_bytes(b"the user's own file\n")
    return str(victim), victim.read_bytes()


# ---- 1. links in the checkpoint folder --------------------------------------------------------

def test_a_planted_tmp_link_is_not_written_through(two_rank, tmp_path):
    victim, before = _victim(tmp_path)
    ckpt = str(tmp_path / "ckpt")
    step_dir = os.path.join(ckpt, ck.step_dirname(1))
    os.makedirs(step_dir, mode=0o700)
    os.symlink(victim, os.path.join(step_dir, ck.shard_filename(0) + ".tmp"))
    os.symlink(victim, os.path.join(step_dir, ck.MANIFEST + ".tmp"))
    _commit(two_rank, ckpt, 1)
    assert open(victim, "rb").read() == before
    assert ck.verifies(ckpt, 1)


def test_a_planted_step_folder_link_is_never_pruned_through(two_rank, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / ck.MANIFEST).write_text('{"precious": true}')
    (outside / "data.tmp").write_text("precious too")
    ckpt = str(tmp_path / "ckpt")
    os.makedirs(ckpt, mode=0o700)
    os.symlink(str(outside), os.path.join(ckpt, ck.step_dirname(0)))
    _commit(two_rank, ckpt, 2, keep=1)
    assert (outside / ck.MANIFEST).read_text() == '{"precious": true}'
    assert (outside / "data.tmp").read_text() == "precious too"
    assert ck.list_step_dirs(ckpt) == [2]  # the link is no step folder


def test_a_step_folder_link_is_refused_when_writing(two_rank, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    ckpt = str(tmp_path / "ckpt")
    os.makedirs(ckpt, mode=0o700)
    os.symlink(str(outside), os.path.join(ckpt, ck.step_dirname(1)))
    with pytest.raises(OSError, match="symbolic link, not a step folder"):
        _commit(two_rank, ckpt, 1)
    assert os.listdir(outside) == []


def test_a_linked_shard_is_not_read(two_rank, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    _commit(two_rank, ckpt, 1)
    step_dir = os.path.join(ckpt, ck.step_dirname(1))
    real = os.path.join(step_dir, ck.shard_filename(0))
    moved = str(tmp_path / "moved.safetensors")
    os.rename(real, moved)
    os.symlink(moved, real)
    assert not ck.verifies(ckpt, 1)
    manifest = ck.read_manifest(ckpt, 1)
    with pytest.raises(CheckpointCorruptError, match="symbolic link"):
        ck.read_shard(ckpt, manifest, manifest["shards"][0])


@pytest.mark.parametrize("mode", [0o777, 0o757])
def test_a_world_writable_checkpoint_folder_is_refused(tmp_path, mode):
    ckpt = tmp_path / "open"
    ckpt.mkdir()
    os.chmod(ckpt, mode)
    with pytest.raises(ValueError) as err:
        ck.check_writable(str(ckpt))
    assert "others can write in it" in str(err.value) and str(ckpt) in str(err.value)
    assert "\n" not in str(err.value)


def test_a_sticky_world_writable_folder_of_ones_own_is_accepted(tmp_path):
    ckpt = tmp_path / "sticky"
    ckpt.mkdir()
    os.chmod(ckpt, 0o1777)
    ck.check_writable(str(ckpt))


def test_a_folder_of_another_user_is_refused(tmp_path):
    if os.geteuid() == 0:  # root can give a folder away: make one of another user's
        folder = tmp_path / "theirs"
        folder.mkdir()
        os.chown(folder, 65534, 65534)  # nobody
    else:  # anyone else: a folder of root's, which every machine has
        folder = Path("/")
        assert folder.stat().st_uid != os.geteuid()
    with pytest.raises(ValueError, match="not to you"):
        ck.check_writable(str(folder))


# ---- 3. bounded reads ---------------------------------------------------------------------------

def _in_thread(fn, timeout=10.0):
    """fn()'s exception (or None), failing the test instead of hanging on a FIFO."""
    out = {}

    def run():
        try:
            fn()
            out["exc"] = None
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["exc"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "hung"
    return out["exc"]


def test_a_fifo_manifest_neither_hangs_a_read_nor_inspect(tmp_path):
    ckpt = tmp_path / "ckpt"
    step_dir = ckpt / ck.step_dirname(3)
    step_dir.mkdir(parents=True)
    os.mkfifo(step_dir / ck.MANIFEST)
    exc = _in_thread(lambda: ck.read_manifest(str(ckpt), 3))
    assert isinstance(exc, CheckpointCorruptError) and "a FIFO" in str(exc)
    got = {}
    assert _in_thread(lambda: got.update(listing.scan(str(ckpt)))) is None
    assert got["checkpoints"][0]["status"] == "corrupt" and "FIFO" in got["checkpoints"][0]["reason"]
    assert ck.newest_committed(str(ckpt)) == -1


def test_a_manifest_linked_to_dev_zero_is_refused(tmp_path):
    step_dir = tmp_path / "ckpt" / ck.step_dirname(3)
    step_dir.mkdir(parents=True)
    os.symlink("/dev/zero", step_dir / ck.MANIFEST)
    exc = _in_thread(lambda: ck.read_manifest(str(tmp_path / "ckpt"), 3))
    assert isinstance(exc, CheckpointCorruptError) and "symbolic link" in str(exc)


def test_a_dev_zero_plan_and_a_fifo_plan_are_refused(tmp_path):
    os.symlink("/dev/zero", tmp_path / "plan.json")
    exc = _in_thread(lambda: load_plan(str(tmp_path)))
    assert isinstance(exc, UntrustedFile) and "character device" in str(exc)
    fifo = tmp_path / "f"
    fifo.mkdir()
    os.mkfifo(fifo / "plan.json")
    exc = _in_thread(lambda: load_plan(str(fifo)))
    assert isinstance(exc, UntrustedFile) and "FIFO" in str(exc)


def test_an_oversized_json_is_refused_unread(tmp_path):
    big = tmp_path / "plan.json"
    with open(big, "wb") as fh:
        fh.truncate(65 << 20)  # sparse: no disk, no memory
    with pytest.raises(UntrustedFile, match="more than the 64 MiB"):
        read_bounded(str(big))
    with pytest.raises(UntrustedFile, match="more than the 64 MiB"):
        load_plan(str(tmp_path))


# ---- 2. a model folder's own code never runs -------------------------------------------------

def test_an_hf_folder_that_needs_its_own_code_is_refused_and_its_code_never_runs(capsys, monkeypatch, tmp_path):
    pytest.importorskip("transformers")
    evil = tmp_path / "evil"
    evil.mkdir()
    marker = tmp_path / "MARKER"
    (evil / "config.json").write_text(json.dumps({
        "model_type": "evil", "architectures": ["EvilForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_evil.EvilConfig",
                     "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}}))
    (evil / "configuration_evil.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "from transformers import PretrainedConfig\n\n\nclass EvilConfig(PretrainedConfig):\n    model_type = 'evil'\n")
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n" * 8))  # `echo y | partitioner compile hf:evil`
    code = main(["compile", f"hf:{evil}", "-o", str(tmp_path / "out"), "-q"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "needs code of its own" in err[0] and "never runs" in err[0] and str(evil) in err[0]
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


def test_a_zstd_bomb_is_refused_before_it_is_decompressed():
    zstandard = pytest.importorskip("zstandard")
    bomb = zstandard.ZstdCompressor(level=1).compress(bytes(256 << 20))  # declares 256 MiB in its header
    assert len(bomb) < 64 << 10
    t = torch.arange(4, dtype=torch.float32)
    good = encode_tensor(t, None)
    meta = {"encoding": {"codec": "xor-byteplanes-zstd/1", "base_step": None, "tensors": {
        "param/w": {"dtype": "F32", "shape": [4], "delta": False, "sha256": hashlib.sha256(t.numpy().tobytes()).hexdigest()}}}}

    def decode(blob):
        return decode_shard({"enc/param/w": torch.frombuffer(bytearray(blob), dtype=torch.uint8)}, meta,
                            lambda key: None, "shard_rank_00000.safetensors")

    assert torch.equal(decode(good)["param/w"], t)
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointCorruptError) as err:
            decode(bomb)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "declares 268435456 bytes, the tensor is 16" in str(err.value) and "\n" not in str(err.value)
    assert peak < 16 << 20, f"{peak} bytes allocated for a 16-byte tensor"


# ---- 4. a lying dtype in pretrained weights ---------------------------------------------------

def test_pretrained_weights_with_a_relabelled_dtype_are_refused_by_name(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "w")
    path = tmp_path / "w" / "model.safetensors"
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    stored = next(k for k in header if k.endswith("wte.weight"))
    assert header[stored]["dtype"] == "F32"
    header[stored]["dtype"] = "I32"  # the same element size: the offsets still hold
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    raw[8:8 + n] = text + b" " * (n - len(text))
    path.write_bytes(bytes(raw))
    model = pretrained.build_meta(config.to_dict(), "GPT2LMHeadModel")
    with pytest.raises(ValueError) as err:
        pretrained.pretrained_weights(model, ["transformer.wte.weight"], str(tmp_path / "w"), 0)
    assert f"{stored} is I32" in str(err.value) and "torch.float32" in str(err.value) and "\n" not in str(err.value)
    config.save_pretrained(tmp_path / "cfg")
    with pytest.raises(ValueError, match=f"{stored} is I32"):  # at compile time
        load_workload(f"hf:{tmp_path / 'cfg'}", pretrained=str(tmp_path / "w"))


def test_a_planted_discarded_link_is_removed_itself_never_followed(tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "keep.txt").write_text("precious")
    ckpt = tmp_path / "ckpt"
    (ckpt / ck.step_dirname(5)).mkdir(parents=True)
    os.symlink(outside, ckpt / ("discarded_" + ck.step_dirname(5)))
    _discard_newer(str(ckpt), 1, 0)
    assert (outside / "keep.txt").read_text() == "precious"
    assert stat.S_ISDIR(os.lstat(ckpt / ("discarded_" + ck.step_dirname(5))).st_mode)  # the step moved there


def test_inspect_of_a_huge_plan_is_one_line_unread(capsys, tmp_path):
    with open(tmp_path / "plan.json", "wb") as fh:
        fh.truncate(65 << 20)  # sparse
    code = main(["inspect", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "more than the 64 MiB" in err[0] and "plan.json" in err[0], err
