"""An opened token source: each split a flat read-only 1-D token array (a numpy memmap: nothing is
read until a window is), its vocabulary size, and the byte counter the batches charge
(``TokenSource``, ``ReadStats``), and the two ``tokens:`` readers: the prepared folder
(``open_prepared``) and the flat file (``open_flat``). sources.py dispatches on the kind.

The prepared folder's layout (written by runtime/data/corpus/prepare.py, read here: the format lives
with its reader so a rank needs no compiler)::

    DATA_DIR/train.bin   the training tokens, flat, META["dtype"] (little-endian)
    DATA_DIR/val.bin     the validation tokens (possibly empty)
    DATA_DIR/meta.json   {"format": "partitioner-tokens", "version": 1, "vocab_size", "dtype",
                          "tokenizer": {"kind", "path", "sha256"}, "eod_id",
                          "splits": {"train"|"val": {"file", "num_tokens", "num_documents",
                                                     "bytes", "sha256"}}, "sources": [...]}
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

import numpy as np

from runtime.data.corpus.spec import TOKEN_DTYPES, CorpusError, CorpusSpec

META_FILE = "meta.json"
META_FORMAT = "partitioner-tokens"
META_VERSION = 1
SPLIT_FILES = {"train": "train.bin", "val": "val.bin"}
SCAN_CHUNK_TOKENS = 1 << 24  # the max-id scan's chunk: 32-64 MiB resident at a time, whatever the corpus
HASH_CHUNK_BYTES = 1 << 22


@dataclass
class ReadStats:
    """Bytes of token data the batches read from this source's splits, and the windows they cut
    (tests and the benchmark assert what a rank reads; the one-off vocabulary scan is not counted)."""

    bytes_read: int = 0
    windows_read: int = 0

    def reset(self) -> None:
        self.bytes_read = self.windows_read = 0


@dataclass
class TokenSource:
    """One opened corpus. ``files[name]`` is the file a split is read from (named in errors)."""

    spec: CorpusSpec
    splits: dict[str, np.ndarray]
    files: dict[str, str]
    known_vocab_size: int | None = None
    meta: dict | None = None
    stats: ReadStats = field(default_factory=ReadStats)

    @property
    def label(self) -> str:
        return self.spec.path

    @property
    def num_tokens(self) -> int:
        return sum(int(a.shape[0]) for a in self.splits.values())

    @property
    def vocab_size(self) -> int:
        """meta.json's, the spec's ``vocab=``, or max id + 1 by one chunked scan (cached)."""
        if self.known_vocab_size is None:
            top = -1
            for array in self.splits.values():
                for start in range(0, array.shape[0], SCAN_CHUNK_TOKENS):
                    top = max(top, int(array[start:start + SCAN_CHUNK_TOKENS].max()))
            if top < 0:
                raise CorpusError(f"{self.label}: holds no tokens: prepare a corpus with `partitioner data prepare`")
            self.known_vocab_size = top + 1
        return self.known_vocab_size

    def split(self, name: str) -> np.ndarray:
        if name not in self.splits:
            raise CorpusError(f"{self.label}: has no {name!r} split (it has {', '.join(sorted(self.splits))}): "
                              f"use split={sorted(self.splits)[0]!r}" + (
                                  ", or put a val.bin beside the file" if self.spec.kind == "tokens" else ""))
        return self.splits[name]

    def verify(self) -> None:
        """The full check: every prepared .bin's sha256 against meta.json (reads every byte; the
        open checked sizes only). Other kinds were checked completely when opened."""
        if self.meta is None:
            return
        for name, entry in self.meta["splits"].items():
            path = self.files[name]
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(HASH_CHUNK_BYTES):
                    digest.update(chunk)
            if digest.hexdigest() != entry["sha256"]:
                raise CorpusError(f"{path}: sha256 {digest.hexdigest()[:12]}... is not meta.json's "
                                  f"{entry['sha256'][:12]}...: the file changed after prepare; prepare the corpus again")


def token_array(path: str, dtype: str, *, offset_bytes: int = 0, count: int | None = None) -> np.ndarray:
    """``path`` as a read-only memmap of ``dtype`` tokens; refused when its size is no whole number
    of tokens. An empty file is an empty array (mmap cannot map 0 bytes)."""
    if not os.path.isfile(path):
        raise CorpusError(f"{path}: no such file: check the path (prepare one with `partitioner data prepare`)")
    itemsize = np.dtype(dtype).itemsize
    size_bytes = os.path.getsize(path) - offset_bytes
    if count is None:
        if size_bytes % itemsize:
            raise CorpusError(f"{path}: {size_bytes} bytes is not a whole number of {dtype} tokens "
                              f"({itemsize} bytes each): the file is truncated, or its dtype is not {dtype}")
        count = size_bytes // itemsize
    if count == 0:
        return np.empty(0, dtype=dtype)
    return np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r", offset=offset_bytes, shape=(count,))


def open_flat(spec: CorpusSpec) -> TokenSource:
    if not os.path.exists(spec.path):
        raise CorpusError(f"{spec.path}: no such file or folder: name a prepared corpus folder (tokens:DIR) or a "
                          "flat file (tokens:FILE.bin,dtype=uint16)")
    if spec.dtype is None:
        raise CorpusError(f"{spec.path}: a flat tokens file needs its dtype: write tokens:{spec.path},dtype=uint16 "
                          "(or dtype=uint32)")
    splits = {"train": token_array(spec.path, spec.dtype)}
    files = {"train": spec.path}
    sibling = os.path.join(os.path.dirname(spec.path), SPLIT_FILES["val"])
    if os.path.basename(spec.path) != SPLIT_FILES["val"] and os.path.isfile(sibling):
        splits["val"], files["val"] = token_array(sibling, spec.dtype), sibling
    source = TokenSource(spec, splits, files, known_vocab_size=spec.vocab_size)
    if spec.vocab_size is None and spec.dtype == "uint32" and source.vocab_size > 1 << 24:
        raise CorpusError(f"{spec.path}: read as uint32 its ids reach {source.vocab_size - 1}: is it uint16? "
                          f"write tokens:{spec.path},dtype=uint16 (or give vocab=V)")
    return source


def read_meta(folder: str) -> dict:
    path = os.path.join(folder, META_FILE)
    if not os.path.isfile(path):
        raise CorpusError(f"{path}: no such file: {folder} is no prepared corpus; prepare one with "
                          "`partitioner data prepare FILE... -o DIR`, or name a flat file as tokens:FILE.bin,dtype=uint16")
    try:
        with open(path) as f:
            meta = json.load(f)
    except json.JSONDecodeError as exc:
        raise CorpusError(f"{path}: not JSON ({exc.msg} at line {exc.lineno}): prepare the corpus again") from None
    except (UnicodeDecodeError, RecursionError):  # binary bytes; nesting deeper than the parser recurses
        raise CorpusError(f"{path}: not a meta.json (not UTF-8 text, or nested too deep): prepare the corpus "
                          "again") from None
    if not isinstance(meta, dict) or meta.get("format") != META_FORMAT or meta.get("version") != META_VERSION:
        raise CorpusError(f"{path}: not a {META_FORMAT} version {META_VERSION} meta.json: prepare the corpus again "
                          "with this version's `partitioner data prepare`")
    if meta.get("dtype") not in TOKEN_DTYPES:
        raise CorpusError(f"{path}: dtype {meta.get('dtype')!r} is not one of {', '.join(TOKEN_DTYPES)}: prepare again")
    why = meta_shape_problem(meta)
    if why:
        raise CorpusError(f"{path}: {why}: the file was edited or cut short; prepare the corpus again")
    return meta


def meta_shape_problem(meta: dict) -> str | None:
    """What is wrong with the fields every reader of meta.json indexes (the splits, the vocabulary,
    the tokenizer), or None: a hand-edited file is one line naming the field, never a KeyError."""
    def shown(value) -> str:
        return json.dumps(value)[:60]

    vocab = meta.get("vocab_size")
    if type(vocab) is not int or vocab < 1:
        return f"vocab_size {shown(vocab)} is not a whole number of tokens >= 1"
    if meta.get("eod_id") is not None and type(meta["eod_id"]) is not int:
        return f"eod_id {shown(meta['eod_id'])} is neither null nor a token id"
    tokenizer = meta.get("tokenizer")
    if not isinstance(tokenizer, dict) or tokenizer.get("kind") not in ("bytes", "huggingface"):
        return f"tokenizer {shown(tokenizer)} is not an object whose kind is bytes or huggingface"
    splits = meta.get("splits")
    if splits is None:
        return "it has no splits"
    if not isinstance(splits, dict) or not splits:
        return f"splits {shown(splits)} is not an object of splits (train, val)"
    for name, entry in splits.items():
        if not isinstance(entry, dict):
            return f"splits.{name} is {shown(entry)}, not an object"
        for key, kind, what in (("file", str, "a file name"), ("bytes", int, "a size"), ("sha256", str, "a digest")):
            if type(entry.get(key)) is not kind:
                return f"splits.{name}.{key} is {shown(entry.get(key))}, not {what}"
    return None


def open_prepared(spec: CorpusSpec) -> TokenSource:
    meta = read_meta(spec.path)
    dtype = meta["dtype"]
    if spec.dtype is not None and spec.dtype != dtype:
        raise CorpusError(f"{spec.path}: dtype={spec.dtype} but its meta.json says {dtype}: drop the dtype= option")
    if spec.vocab_size is not None and spec.vocab_size != meta["vocab_size"]:
        raise CorpusError(f"{spec.path}: vocab={spec.vocab_size} but its meta.json says {meta['vocab_size']}: drop "
                          "the vocab= option")
    splits, files = {}, {}
    for name, entry in meta["splits"].items():
        path = os.path.join(spec.path, entry["file"])
        if os.path.isfile(path) and os.path.getsize(path) != entry["bytes"]:
            raise CorpusError(f"{path}: {os.path.getsize(path)} bytes, meta.json says {entry['bytes']}: the file "
                              "is truncated or was replaced; prepare the corpus again")
        splits[name], files[name] = token_array(path, dtype), path
    return TokenSource(spec, splits, files, known_vocab_size=int(meta["vocab_size"]), meta=meta)
