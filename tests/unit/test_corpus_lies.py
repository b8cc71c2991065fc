"""Issue 42 findings 2-4, corpora that lie: a prepared folder or an hf-disk folder whose metadata
names files outside it (Note [files inside the corpus folder]); token ids outside the vocabulary,
at open, in a window read after the file changed, against the model's vocabulary (Note [ids inside
the vocabulary]); `data prepare` writing a tokenizer's sparse ids unwrapped. Real files, tiny."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

from partitioner.cli import main
from partitioner.models.text_codec import codec_of_folder
from runtime.data.corpus import CorpusError, CorpusSpec, open_source
from runtime.data.corpus.batches import forget_sources, make_batch, rows
from runtime.data.corpus.prepare import decode, prepare
from test_corpus_formats import write_megatron


@pytest.fixture(autouse=True)
def _fresh_sources():
    forget_sources()
    yield
    forget_sources()


def _corpus(tmp_path: Path, text: str = "hello world, " * 40) -> Path:
    (tmp_path / "a.txt").write_text(text)
    out = tmp_path / "corpus"
    prepare([tmp_path / "a.txt"], out, val_fraction=0)
    return out


def _reseal(out: Path, edit) -> None:
    """meta.json edited the way a liar would: every size and sha256 made to match what it names."""
    meta = json.loads((out / "meta.json").read_text())
    edit(meta)
    for entry in meta["splits"].values():
        data = Path(os.path.normpath(out / entry["file"])).read_bytes()
        entry["bytes"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    (out / "meta.json").write_text(json.dumps(meta))


def _secret(tmp_path: Path) -> Path:
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "private.bin").write_bytes(np.arange(100, 200, dtype=np.uint16).tobytes())
    return secret / "private.bin"


def _one_line(capsys, argv, *needles) -> str:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and err[0].startswith("error: "), err
    for needle in needles:
        assert needle in err[0], (needle, err[0])
    return err[0]


# ---- finding 2: the files a corpus names stay inside its folder --------------------------------

@pytest.mark.parametrize("name", ["../secret/private.bin", "ABSOLUTE", "train.bin/../../secret/private.bin"])
def test_a_split_file_outside_the_folder_is_refused(tmp_path, capsys, name):
    out, secret = _corpus(tmp_path), _secret(tmp_path)
    name = str(secret) if name == "ABSOLUTE" else name
    _reseal(out, lambda meta: meta["splits"]["train"].update(file=name))
    with pytest.raises(CorpusError, match=f"split 'train' names file {name!r}, not 'train.bin'"):
        open_source(CorpusSpec.parse(f"tokens:{out}"))
    _one_line(capsys, ["data", "check", f"tokens:{out}"], repr(name), "prepare the corpus again")


def test_a_split_file_linked_outside_the_folder_is_refused(tmp_path, capsys):
    out, secret = _corpus(tmp_path), _secret(tmp_path)
    (out / "train.bin").unlink()
    (out / "train.bin").symlink_to(secret)
    _reseal(out, lambda meta: None)
    with pytest.raises(CorpusError, match=f"{out}/train.bin: resolves to {secret}, outside {out}"):
        open_source(CorpusSpec.parse(f"tokens:{out}"))
    _one_line(capsys, ["data", "check", f"tokens:{out}"], "outside", "copy the file into the folder")
    inside = out / "store"  # a link that stays in the folder is the user's own layout
    inside.mkdir()
    os.replace(secret, inside / "tokens.bin")
    (out / "train.bin").unlink()
    (out / "train.bin").symlink_to(inside / "tokens.bin")
    _reseal(out, lambda meta: None)
    assert open_source(CorpusSpec.parse(f"tokens:{out}")).split("train").tolist() == list(range(100, 200))


def _tokenizer(path: Path, vocab: dict[str, int]) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers  # lazy: only the tokenizer cases build one

    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))
    return path


def test_a_tokenizer_file_outside_the_folder_is_refused(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 20)
    tok = _tokenizer(tmp_path / "tok.json", {"[UNK]": 0, "hello": 1, "world": 2})
    out = tmp_path / "corpus"
    prepare([tmp_path / "a.txt"], out, tokenizer=str(tok), val_fraction=0)
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "tokenizer.json").write_bytes((out / "tokenizer.json").read_bytes())
    for name in ("../elsewhere/tokenizer.json", str(other / "tokenizer.json"), None):
        _reseal(out, lambda meta: meta["tokenizer"].update(file=name))
        with pytest.raises(CorpusError, match=f"tokenizer names file {name!r}, not 'tokenizer.json'"):
            decode([1, 2], str(out))
        with pytest.raises(CorpusError, match=f"tokenizer names file {name!r}"):
            codec_of_folder(str(out))
    _reseal(out, lambda meta: meta["tokenizer"].update(file="tokenizer.json"))
    (out / "tokenizer.json").unlink()
    (out / "tokenizer.json").symlink_to(other / "tokenizer.json")
    with pytest.raises(CorpusError, match="tokenizer.json: resolves to .*, outside"):
        decode([1, 2], str(out))


def _hf_folder(folder: Path, filenames: list[str]) -> Path:
    """The files ``datasets.save_to_disk`` writes for one Dataset (written by hand: the check runs
    before datasets is imported, so it holds whether or not datasets is installed here)."""
    folder.mkdir(parents=True)
    (folder / "dataset_info.json").write_text("{}")
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": f} for f in filenames],
                                                   "_fingerprint": "0", "_split": None}))
    return folder


@pytest.mark.parametrize("name", ["/etc/passwd", "../outside.arrow", "data/../../outside.arrow"])
def test_an_hf_disk_data_file_outside_the_folder_is_refused(tmp_path, name):
    folder = _hf_folder(tmp_path / "hf", ["data-00000-of-00001.arrow", name])
    with pytest.raises(CorpusError, match=f"{folder}/state.json: data file {name!r} resolves to .*, outside {folder}"):
        open_source(CorpusSpec.parse(f"hf-disk:{folder}"))


def test_an_hf_disk_split_outside_the_folder_is_refused(tmp_path):
    folder = tmp_path / "hf"
    _hf_folder(folder / "train", ["data-00000-of-00001.arrow"])
    _hf_folder(tmp_path / "elsewhere", ["data-00000-of-00001.arrow"])
    (folder / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "../elsewhere"]}))
    with pytest.raises(CorpusError, match=f"{folder}/dataset_dict.json: split '../elsewhere' resolves to .*, outside"):
        open_source(CorpusSpec.parse(f"hf-disk:{folder}"))
    (folder / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    (folder / "train" / "state.json").write_text(json.dumps({"_data_files": [{"filename": "/etc/passwd"}]}))
    with pytest.raises(CorpusError, match=f"{folder}/train/state.json: data file '/etc/passwd'"):
        open_source(CorpusSpec.parse(f"hf-disk:{folder}"))


def test_a_saved_datasets_folder_naming_another_folders_data_is_refused(tmp_path):
    datasets = pytest.importorskip("datasets", reason="datasets is not installed")
    datasets.Dataset.from_list([{"input_ids": [1, 2, 3]}] * 4).save_to_disk(str(tmp_path / "hf"))
    datasets.Dataset.from_list([{"input_ids": [7, 7, 7]}] * 4).save_to_disk(str(tmp_path / "private"))
    assert open_source(CorpusSpec.parse(f"hf-disk:{tmp_path}/hf")).split("train").tolist() == [1, 2, 3] * 4
    state = json.loads((tmp_path / "hf" / "state.json").read_text())
    theirs = json.loads((tmp_path / "private" / "state.json").read_text())["_data_files"][0]["filename"]
    state["_data_files"] = [{"filename": f"../private/{theirs}"}]
    (tmp_path / "hf" / "state.json").write_text(json.dumps(state))
    with pytest.raises(CorpusError, match=f"data file '../private/{theirs}' resolves to {tmp_path}/private/"):
        open_source(CorpusSpec.parse(f"hf-disk:{tmp_path}/hf"))


# ---- finding 3: ids outside the vocabulary never reach the embedding ---------------------------

def test_a_meta_json_vocabulary_smaller_than_its_ids_is_refused(tmp_path, capsys):
    out = _corpus(tmp_path)  # bytes: "hello world, " reaches id 119 ("w")
    _reseal(out, lambda meta: meta.update(vocab_size=64))
    with pytest.raises(CorpusError, match=rf"{out}/train.bin: token \d+ is id 1\d\d, but {out}/meta.json says "
                                          r"the vocabulary is 64"):
        open_source(CorpusSpec.parse(f"tokens:{out}"))
    _one_line(capsys, ["data", "check", f"tokens:{out}"], "meta.json says the vocabulary is 64")
    from partitioner.frontend.corpus_data import with_corpus  # lazy: the compile side's check, torch and models
    from partitioner.models.builtin import load_workload  # lazy: as above

    with pytest.raises(ValueError, match=f"--data tokens:{out}: .*train.bin: token .* the vocabulary is 64"):
        with_corpus(load_workload("gpt:layers=1,width=16,heads=2,seq=8,vocab=64"), f"tokens:{out}")


def test_a_flat_file_beyond_its_vocab_option_is_refused(tmp_path):
    path = tmp_path / "tokens.bin"
    np.array([1, 2, 3, 900, 4] * 10, dtype=np.uint16).tofile(path)
    with pytest.raises(CorpusError, match=rf"{path}: token 3 is id 900, but vocab=512 says the vocabulary is 512"):
        open_source(CorpusSpec.parse(f"tokens:{path},dtype=uint16,vocab=512"))
    assert open_source(CorpusSpec.parse(f"tokens:{path},dtype=uint16")).vocab_size == 901


@pytest.mark.parametrize("dtype", [np.int32, np.int16, np.int64])
def test_negative_megatron_ids_are_refused(tmp_path, dtype):
    write_megatron(tmp_path / "m", [[5, 6, 7, 0], [9, -3, 0]], dtype)
    with pytest.raises(CorpusError, match=rf"{tmp_path}/m.bin: token 5 is id -3, and ids are never negative"):
        open_source(CorpusSpec.parse(f"megatron:{tmp_path}/m"))


def test_negative_hf_disk_ids_are_refused(tmp_path):
    datasets = pytest.importorskip("datasets", reason="datasets is not installed")
    datasets.Dataset.from_list([{"input_ids": [4, 5, 6]}, {"input_ids": [7, -2, 9]}]).save_to_disk(str(tmp_path / "hf"))
    with pytest.raises(CorpusError, match=rf"{tmp_path}/hf: token 4 is id -2, and ids are never negative"):
        open_source(CorpusSpec.parse(f"hf-disk:{tmp_path}/hf"))


def test_a_window_changed_after_open_is_refused_where_it_is_read(tmp_path):
    out = _corpus(tmp_path)
    opened = open_source(CorpusSpec.parse(f"tokens:{out}"))
    make_batch(0, 4, source=opened, seq=8)
    with open(out / "train.bin", "r+b") as f:  # in place, as a writer that reuses the file would
        f.write(np.full(200, 60000, dtype=np.uint16).tobytes())
    with pytest.raises(CorpusError, match=rf"{out}/train.bin: token \d+ is id 60000 now, outside the vocabulary of "
                                          r"256 checked when it was opened: the file changed"):
        for step in range(20):
            make_batch(step, 4, source=opened, seq=8)


def test_ids_at_or_past_the_models_vocabulary_are_refused_on_the_rank(tmp_path):
    out = _corpus(tmp_path)
    with pytest.raises(CorpusError, match=rf"{out}/train.bin: holds id 119, but the model embeds 100 ids: build "
                                          r"the model with vocab >= 120"):
        rows(0, 4, source=f"tokens:{out}", seq=8, rows=range(2), want="inputs", vocab=100)
    (x,), y = make_batch(0, 4, source=f"tokens:{out}", seq=8, vocab=120)
    assert int(x.max()) < 120 and int(y.max()) < 120


# ---- finding 4: data prepare writes the tokenizer's ids, never wrapped -------------------------

def test_prepare_keeps_ids_beyond_the_tokenizers_entry_count(tmp_path):
    (tmp_path / "a.txt").write_text("hello world hello")
    tok = _tokenizer(tmp_path / "tok.json", {"[UNK]": 0, "hello": 1, "world": 70000})
    out = tmp_path / "corpus"
    meta = prepare([tmp_path / "a.txt"], out, tokenizer=str(tok), val_fraction=0)
    assert meta["vocab_size"] == 70001 and meta["dtype"] == "uint32"
    assert np.fromfile(out / "train.bin", dtype="<u4").tolist() == [1, 70000, 1]
    assert open_source(CorpusSpec.parse(f"tokens:{out}")).vocab_size == 70001


def test_a_narrowing_cast_is_checked(tmp_path):
    from runtime.data.corpus.prepare import _SplitWriter  # lazy: the cast site itself

    writer = _SplitWriter(str(tmp_path / "train.bin"), "uint16")
    with pytest.raises(CorpusError, match=r"a.txt: the tokenizer gave id 70000, which uint16 cannot hold"):
        writer.write(np.array([1, 70000], dtype=np.int64), documents=1, origin="a.txt")
    with pytest.raises(CorpusError, match=r"a.txt: the tokenizer gave id -1"):
        writer.write(np.array([-1], dtype=np.int64), documents=1, origin="a.txt")
    assert writer.close()["num_tokens"] == 0
