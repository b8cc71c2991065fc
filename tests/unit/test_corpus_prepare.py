"""`partitioner data prepare`: text and JSONL tokenized into a corpus folder and decoded back, its
meta.json, the atomic write, and the command's one-line errors (runtime/data/corpus/prepare.py)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from runtime.data.corpus.prepare import decode, prepare
from runtime.data.corpus import CorpusError, CorpusSpec, open_source

REPO = Path(__file__).resolve().parents[2]
TEXTS = ["The first document. Ünïcödé too: ✓\n", "a second, shorter one\n", "third: 12345 tokens? no.\n",
         "fourth document here\n"]


def _write_texts(folder: Path) -> list[str]:
    paths = []
    for i, text in enumerate(TEXTS):
        path = folder / f"doc{i}.txt"
        path.write_text(text, encoding="utf-8")
        paths.append(str(path))
    return paths


def _ids(out: Path, split: str, meta: dict) -> np.ndarray:
    return np.fromfile(out / f"{split}.bin", dtype=meta["dtype"])


@pytest.mark.parametrize("append_eod", [False, True])
def test_bytes_round_trip(tmp_path, append_eod):
    out = tmp_path / "corpus"
    meta = prepare(_write_texts(tmp_path), out, tokenizer="bytes", val_fraction=0.25, append_eod=append_eod)
    ids = np.concatenate([_ids(out, "train", meta), _ids(out, "val", meta)])
    assert decode(ids, str(out)) == "".join(TEXTS)
    assert meta["vocab_size"] == (257 if append_eod else 256) and meta["dtype"] == "uint16"
    assert meta["eod_id"] == (256 if append_eod else None)
    assert (int((ids == 256).sum()) == len(TEXTS)) is append_eod
    # the last quarter of the documents is the validation split: exactly the fourth
    assert meta["splits"]["val"]["num_documents"] == 1 and meta["splits"]["train"]["num_documents"] == 3
    assert decode(_ids(out, "val", meta), str(out)) == TEXTS[-1]
    for split in ("train", "val"):
        entry, data = meta["splits"][split], (out / f"{split}.bin").read_bytes()
        assert entry["sha256"] == hashlib.sha256(data).hexdigest() and entry["bytes"] == len(data)
        assert entry["num_tokens"] == len(data) // 2
    assert json.loads((out / "meta.json").read_text()) == meta
    assert [s["path"] for s in meta["sources"]] == [str(tmp_path / f"doc{i}.txt") for i in range(len(TEXTS))]
    open_source(CorpusSpec.parse(f"tokens:{out}")).verify()


def test_single_document_is_split_by_tokens(tmp_path):
    (tmp_path / "one.txt").write_text("x" * 1000)
    meta = prepare([tmp_path / "one.txt"], tmp_path / "c", val_fraction=0.1)
    assert meta["split_by"] == "tokens"
    assert (meta["splits"]["train"]["num_tokens"], meta["splits"]["val"]["num_tokens"]) == (900, 100)


def _byte_level_tokenizer(folder: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # lazy: only these tests train one

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(TEXTS * 4, trainer)
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


@pytest.mark.parametrize("append_eod", [False, True])
def test_huggingface_tokenizer_round_trip(tmp_path, append_eod):
    tok_dir = _byte_level_tokenizer(tmp_path / "tok")
    out = tmp_path / "corpus"
    meta = prepare(_write_texts(tmp_path), out, tokenizer=str(tok_dir), val_fraction=0.25, append_eod=append_eod)
    from tokenizers import Tokenizer  # lazy: as above

    tokenizer = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    assert meta["tokenizer"]["kind"] == "huggingface"
    assert meta["tokenizer"]["sha256"] == hashlib.sha256((tok_dir / "tokenizer.json").read_bytes()).hexdigest()
    assert meta["vocab_size"] == tokenizer.get_vocab_size(with_added_tokens=True)
    assert meta["eod_id"] == (tokenizer.token_to_id("<|endoftext|>") if append_eod else None)
    ids = np.concatenate([_ids(out, "train", meta), _ids(out, "val", meta)])
    assert ids.shape[0] < sum(len(t.encode()) for t in TEXTS)  # merges happened: not bytes in disguise
    assert decode(ids, str(out)) == "".join(TEXTS)
    (tok_dir / "tokenizer.json").unlink()  # the folder's own copy decodes it
    assert decode(ids, str(out), eod_text="|") == ("|".join(TEXTS) + "|" if append_eod else "".join(TEXTS))


def test_append_eod_refused_without_an_end_token(tmp_path):
    from tokenizers import Tokenizer, models  # lazy: as above

    path = tmp_path / "tokenizer.json"
    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(path))
    with pytest.raises(CorpusError, match="--append-eod: .*tokenizer.json has no end-of-text token"):
        prepare(_write_texts(tmp_path), tmp_path / "c", tokenizer=str(path), append_eod=True)
    assert not (tmp_path / "c").exists()


def test_jsonl_with_a_json_key(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"body": t, "id": i}) + "\n" for i, t in enumerate(TEXTS)) + "\n")
    meta = prepare([path], tmp_path / "c", json_key="body", val_fraction=0.5, append_eod=True)
    assert meta["splits"]["train"]["num_documents"] == 2 and meta["splits"]["val"]["num_documents"] == 2
    ids = np.concatenate([_ids(tmp_path / "c", "train", meta), _ids(tmp_path / "c", "val", meta)])
    assert decode(ids, str(tmp_path / "c"), eod_text="\0") == "\0".join(TEXTS) + "\0"
    with pytest.raises(CorpusError, match=r"docs.jsonl:1: no string field 'text' \(it has body, id\): pass --json-key"):
        prepare([path], tmp_path / "d")


def test_an_error_midway_leaves_no_folder(tmp_path):
    good = _write_texts(tmp_path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "fine too"}\n{not json\n')
    before = set(os.listdir(tmp_path))
    seen = []
    with pytest.raises(CorpusError, match=r"bad.jsonl:3: not JSON"):
        prepare([*good, str(bad)], tmp_path / "c", progress=lambda done, total: seen.append(done))
    assert seen, "the error came after documents were written, not before"
    assert set(os.listdir(tmp_path)) == before  # no out_dir, no temporary folder left beside it


def test_an_existing_folder_is_refused_unless_overwrite(tmp_path):
    files = _write_texts(tmp_path)
    out = tmp_path / "c"
    prepare(files[:1], out, val_fraction=0)
    with pytest.raises(CorpusError, match=r"c: already exists: .*--overwrite"):
        prepare(files, out)
    meta = prepare(files, out, overwrite=True, val_fraction=0)
    assert meta["splits"]["train"]["num_documents"] == len(TEXTS)
    assert sorted(os.listdir(tmp_path)) == sorted([*(Path(f).name for f in files), "c"])
    (tmp_path / "other").mkdir()
    with pytest.raises(CorpusError, match="exists and is no prepared corpus"):
        prepare(files, tmp_path / "other", overwrite=True)


def _cli(*args, cwd):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "partitioner", "data", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_cli_prepares_then_refuses_in_one_line(tmp_path):
    _write_texts(tmp_path)
    ok = _cli("prepare", "doc0.txt", "doc1.txt", "-o", "corpus", "--tokenizer", "bytes", "--append-eod", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert "vocab 257" in ok.stdout and "tokenizing 100.0%" in ok.stderr
    assert (tmp_path / "corpus" / "meta.json").is_file()
    again = _cli("prepare", "doc0.txt", "-o", "corpus", "--tokenizer", "bytes", cwd=tmp_path)
    missing = _cli("prepare", "nope.txt", "-o", "c2", "--tokenizer", "bytes", cwd=tmp_path)
    misspelt = _cli("prepare", "doc0.txt", "-o", "c2", "--tokenizer", "bytes", "--append-eot", cwd=tmp_path)
    for result, named in ((again, "corpus: already exists"), (missing, "nope.txt: no such file"),
                          (misspelt, "unknown flag --append-eot: did you mean --append-eod?")):
        assert result.returncode != 0
        lines = result.stderr.strip().splitlines()
        assert lines[-1].startswith("error: ") and named in lines[-1], result.stderr
        assert "Traceback" not in result.stderr and sum(line.startswith("error:") for line in lines) == 1
    # same size, same ids in another order: only the full sha256 of `data check` sees it
    train = tmp_path / "corpus" / "train.bin"
    train.write_bytes(np.fromfile(train, dtype="<u2")[::-1].tobytes())
    check = _cli("check", "tokens:corpus", cwd=tmp_path)
    assert check.returncode != 0 and "Traceback" not in check.stderr
    assert check.stderr.strip().startswith("error: ") and "train.bin: sha256" in check.stderr, check.stderr
