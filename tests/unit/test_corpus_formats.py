"""The token sources runtime/data/corpus/ opens: a flat nanoGPT-style .bin, Megatron-LM's .bin/.idx
pair (written here byte for byte as Megatron's builder does), a prepared folder's checks, a
``datasets`` folder; and each refusal naming its file."""

from __future__ import annotations

import json
import sys
import struct

import numpy as np
import pytest

from runtime.data.corpus.prepare import prepare
from runtime.data.corpus import CorpusError, CorpusSpec, open_source
from runtime.data.corpus.batches import make_batch, rows

MEGATRON_CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.float64: 6, np.float32: 7,
                  np.uint16: 8}


def write_megatron(prefix, documents: list[list[int]], dtype=np.uint16) -> None:
    """Megatron's IndexedDatasetBuilder: add_document per document (one sequence each), then
    finalize: the .bin back to back, the .idx as _IndexWriter lays it out."""
    lengths, document_indices = [], [0]
    with open(f"{prefix}.bin", "wb") as f:
        for doc in documents:
            f.write(np.array(doc, dtype=dtype).tobytes(order="C"))
            lengths.append(len(doc))
            document_indices.append(len(lengths))
    itemsize = np.dtype(dtype).itemsize
    pointers = np.concatenate([[0], np.cumsum(np.array(lengths, dtype=np.int64) * itemsize)[:-1]]).astype(np.int64)
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", MEGATRON_CODES[dtype]))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(document_indices)))
        f.write(np.array(lengths, dtype=np.int32).tobytes(order="C"))
        f.write(pointers.tobytes(order="C"))
        f.write(np.array(document_indices, dtype=np.int64).tobytes(order="C"))


DOCS = [[5, 6, 7, 0], [9, 8, 0], list(range(100, 140)) + [0]]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_megatron_reads_the_documents_back_to_back(tmp_path, dtype):
    write_megatron(tmp_path / "corpus_text_document", DOCS, dtype)
    for spec in (f"megatron:{tmp_path}/corpus_text_document", f"megatron:{tmp_path}/corpus_text_document.bin"):
        source = open_source(CorpusSpec.parse(spec))
        assert source.split("train").tolist() == [t for doc in DOCS for t in doc]
        assert source.vocab_size == 140 and source.num_tokens == 48
    assert open_source(CorpusSpec.parse(f"megatron:{tmp_path}/corpus_text_document,vocab=50257")).vocab_size == 50257
    (x,), y = make_batch(0, 4, source=f"megatron:{tmp_path}/corpus_text_document", seq=8)
    assert x.shape == y.shape == (4, 8) and (x[:, 1:] == y[:, :-1]).all()
    with pytest.raises(CorpusError, match="has no 'val' split"):
        open_source(CorpusSpec.parse(f"megatron:{tmp_path}/corpus_text_document")).split("val")


def test_megatron_bad_magic_version_and_float_are_refused(tmp_path):
    prefix = tmp_path / "c"
    write_megatron(prefix, DOCS)
    good = (tmp_path / "c.idx").read_bytes()
    for broken, says in ((b"NOTANIDX\x00" + good[9:], "not a Megatron index"),
                         (good[:9] + struct.pack("<Q", 2) + good[17:], "version 2"),
                         (good[:17] + struct.pack("<B", 7) + good[18:], "float32, not integer ids"),
                         (good[:-8], "truncated or corrupt")):
        (tmp_path / "c.idx").write_bytes(broken)
        with pytest.raises(CorpusError, match=f"{tmp_path}/c.idx: .*{says}"):
            open_source(CorpusSpec.parse(f"megatron:{prefix}"))


def test_megatron_bin_not_matching_its_index_is_refused(tmp_path):
    prefix = tmp_path / "c"
    write_megatron(prefix, DOCS)
    data = (tmp_path / "c.bin").read_bytes()
    (tmp_path / "c.bin").write_bytes(data[:-4])
    with pytest.raises(CorpusError, match=f"{tmp_path}/c.bin: 92 bytes, but .*c.idx.s sequences end at byte 96"):
        open_source(CorpusSpec.parse(f"megatron:{prefix}"))
    (tmp_path / "c.bin").unlink()
    with pytest.raises(CorpusError, match=f"{tmp_path}/c.bin: no such file"):
        open_source(CorpusSpec.parse(f"megatron:{prefix}"))


def test_flat_file_nanogpt_style(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 50257, 5000).astype(np.uint16)
    tokens.tofile(tmp_path / "train.bin")
    source = open_source(CorpusSpec.parse(f"tokens:{tmp_path}/train.bin,dtype=uint16"))
    assert np.array_equal(source.split("train"), tokens) and "val" not in source.splits
    assert source.vocab_size == int(tokens.max()) + 1
    tokens[:500].tofile(tmp_path / "val.bin")
    source = open_source(CorpusSpec.parse(f"tokens:{tmp_path}/train.bin,dtype=uint16"))
    assert np.array_equal(source.split("val"), tokens[:500]) and source.num_tokens == 5500
    (x,), y = make_batch(3, 8, source=source, seq=32, split="val")
    assert x.dtype == y.dtype == __import__("torch").int64 and x.shape == (8, 32)
    with pytest.raises(CorpusError, match="needs its dtype: write tokens:.*train.bin,dtype=uint16"):
        open_source(CorpusSpec.parse(f"tokens:{tmp_path}/train.bin"))
    with pytest.raises(CorpusError, match=r"dtype=float32 is not a token dtype"):
        CorpusSpec.parse(f"tokens:{tmp_path}/train.bin,dtype=float32")
    (tmp_path / "odd.bin").write_bytes(b"\0" * 7)
    with pytest.raises(CorpusError, match=f"{tmp_path}/odd.bin: 7 bytes is not a whole number of uint16 tokens"):
        open_source(CorpusSpec.parse(f"tokens:{tmp_path}/odd.bin,dtype=uint16"))
    with pytest.raises(CorpusError, match=f"{tmp_path}/gone.bin: no such file"):
        open_source(CorpusSpec.parse(f"tokens:{tmp_path}/gone.bin,dtype=uint16"))


def test_uint16_data_read_as_uint32_is_caught(tmp_path):
    np.full(1000, 50000, dtype=np.uint16).tofile(tmp_path / "t.bin")
    with pytest.raises(CorpusError, match="read as uint32 its ids reach .* is it uint16"):
        open_source(CorpusSpec.parse(f"tokens:{tmp_path}/t.bin,dtype=uint32"))


def test_spec_text_round_trips():
    for text in ("tokens:/d", "tokens:/x/train.bin,dtype=uint16", "megatron:/p/c,vocab=50257", "hf-disk:/h"):
        assert CorpusSpec.parse(text).to_text() == text
    assert CorpusSpec.parse("tokens:/x.bin,vocab=9,dtype=uint32") == CorpusSpec("tokens", "/x.bin", "uint32", 9)
    for bad, says in (("/just/a/path", "has no kind"), ("parquet:/x", "is not one of"), ("tokens:/x,stride=3", "option")):
        with pytest.raises(CorpusError, match=says):
            CorpusSpec.parse(bad)


def test_prepared_folder_checks(tmp_path):
    (tmp_path / "a.txt").write_text("hello " * 100)
    (tmp_path / "b.txt").write_text("world " * 100)
    out = tmp_path / "c"
    prepare([tmp_path / "a.txt", tmp_path / "b.txt"], out, val_fraction=0.5)
    source = open_source(CorpusSpec.parse(f"tokens:{out}"))
    assert source.vocab_size == 256 and source.num_tokens == 1200
    with pytest.raises(CorpusError, match="dtype=uint32 but its meta.json says uint16"):
        open_source(CorpusSpec.parse(f"tokens:{out},dtype=uint32"))
    with pytest.raises(CorpusError, match=f"{out}/train.bin: 600 tokens, shorter than one window of seq=600"):
        make_batch(0, 1, source=source, seq=600)
    with pytest.raises(CorpusError, match=r"make 5 windows of seq=100, fewer than one global batch of 8 \(needs 801"):
        rows(0, 8, source=source, seq=100, rows=range(2), want=None)
    data = (out / "train.bin").read_bytes()
    # the same ids in another order: open passes (sizes and id range hold), verify does not
    (out / "train.bin").write_bytes(np.frombuffer(data, dtype="<u2")[::-1].tobytes())
    open_source(CorpusSpec.parse(f"tokens:{out}"))
    with pytest.raises(CorpusError, match=f"{out}/train.bin: sha256 .* is not meta.json's"):
        open_source(CorpusSpec.parse(f"tokens:{out}")).verify()
    (out / "train.bin").write_bytes(data[:-2])
    with pytest.raises(CorpusError, match=f"{out}/train.bin: 1198 bytes, meta.json says 1200"):
        open_source(CorpusSpec.parse(f"tokens:{out}"))
    meta = json.loads((out / "meta.json").read_text())
    (out / "meta.json").write_text(json.dumps({**meta, "version": 99}))
    with pytest.raises(CorpusError, match=f"{out}/meta.json: not a partitioner-tokens version 1"):
        open_source(CorpusSpec.parse(f"tokens:{out}"))
    (out / "meta.json").unlink()
    with pytest.raises(CorpusError, match=f"{out}/meta.json: no such file"):
        open_source(CorpusSpec.parse(f"tokens:{out}"))


def test_hf_disk_input_ids(tmp_path):
    datasets = pytest.importorskip("datasets", reason="datasets is not installed")
    rows_ = [{"input_ids": list(range(i, i + 20))} for i in range(0, 200, 20)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows_[:8]),
                          "validation": datasets.Dataset.from_list(rows_[8:])}).save_to_disk(str(tmp_path / "hf"))
    source = open_source(CorpusSpec.parse(f"hf-disk:{tmp_path}/hf"))
    assert source.split("train").tolist() == list(range(160)) and source.split("val").tolist() == list(range(160, 200))
    datasets.Dataset.from_list([{"text": "x"}]).save_to_disk(str(tmp_path / "raw"))
    with pytest.raises(CorpusError, match="has no input_ids column"):
        open_source(CorpusSpec.parse(f"hf-disk:{tmp_path}/raw"))


def test_hf_disk_without_datasets_names_the_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # absent, whether or not it is installed here
    with pytest.raises(CorpusError, match=f"{tmp_path}: hf-disk: corpora need the datasets package: pip install datasets"):
        open_source(CorpusSpec.parse(f"hf-disk:{tmp_path}"))
