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
    DATA_DIR/tokenizer.json  a huggingface tokenizer's copy (meta.json's "tokenizer": {"file"})

Note [files inside the corpus folder]: a corpus folder is data someone else may have written, and
its metadata names files: a prepared folder's split "file" and "tokenizer": {"file"}, a
``datasets`` folder's state.json "_data_files" and dataset_dict.json "splits". Joined unchecked,
``../secret/private.bin`` or ``/etc/passwd`` would train a model on that file (and ``generate`` or
``export`` leak what it memorised), whatever sha256 meta.json re-seals. So a prepared folder's
files are exactly the names this format defines (``SPLIT_FILES``, ``TOKENIZER_FILE``), and every
name, ours or datasets', is resolved (links followed) and refused unless it stays inside the
folder (``inside``): no ``..``, no absolute path, no link leaving the folder; a link within it is
the user's own layout. A prepared folder's reader opens the resolved path, so a link swapped after
the check cannot redirect its read (datasets opens its own joined names: hf-disk's check is as
good as the folder is still when the run starts).

Note [ids inside the vocabulary]: an id at or past the model's vocabulary fails mid-run with an
empty ``RuntimeError:`` on a CPU or checking GPU, and on a device that does not check bounds it
indexes another row of the embedding: silent garbage. A negative one (Megatron's and hf-disk's
signed ids) does the same. Three checks keep every id in [0, vocab): (1) where a source is opened
(``open_source``) each split is scanned once for its smallest and largest id (chunked, cached on
the ``TokenSource``: one pass of reading per process) and refused when an id is negative or at or
past the vocabulary the corpus claims (meta.json's, ``vocab=``); the compiler opens it too, so a
meta.json that claims less than its ids is refused at compile time; (2) the compiler refuses a
model whose vocabulary is below the corpus's and hands the rank the model's vocabulary
(partitioner/frontend/corpus_data.py), which the rank checks the scanned ids against once;
(3) every window is range-checked where it is read (runtime/data/corpus/batches.py: a min and max
over the few tokens just copied, free beside the read), so a file changed in place after it was
opened fails on that rank with one line naming the file, the id and the vocabulary.
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
TOKENIZER_FILE = "tokenizer.json"  # the folder keeps its tokenizer, so decode works when the original moves
SCAN_CHUNK_TOKENS = 1 << 24  # the id scan's chunk: 32-128 MiB resident at a time, whatever the corpus
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
    id_ranges: dict[str, tuple[int, int] | None] = field(default_factory=dict)  # the scan's, per split

    @property
    def label(self) -> str:
        return self.spec.path

    @property
    def num_tokens(self) -> int:
        return sum(int(a.shape[0]) for a in self.splits.values())

    @property
    def vocab_size(self) -> int:
        """meta.json's, the spec's ``vocab=``, or the largest id + 1 by the scan."""
        if self.known_vocab_size is None:
            top = self.largest_id()
            if top is None:
                raise CorpusError(f"{self.label}: holds no tokens: prepare a corpus with `partitioner data prepare`")
            self.known_vocab_size = top + 1
        return self.known_vocab_size

    def id_range(self, name: str) -> tuple[int, int] | None:
        """(smallest, largest) id of a split by one chunked scan, cached; None when it is empty.
        An unsigned split's smallest is taken as 0 (it cannot be negative; one pass, not two)."""
        if name not in self.id_ranges:
            array, low, high = self.splits[name], 0, None
            for start in range(0, array.shape[0], SCAN_CHUNK_TOKENS):
                chunk = array[start:start + SCAN_CHUNK_TOKENS]
                high = max(int(chunk.max()), -1 if high is None else high)
                if array.dtype.kind == "i":
                    low = min(low, int(chunk.min()))
            self.id_ranges[name] = None if high is None else (low, high)
        return self.id_ranges[name]

    def largest_id(self) -> int | None:
        ranges = [r for r in map(self.id_range, self.splits) if r is not None]
        return max(high for _, high in ranges) if ranges else None

    def check_ids(self) -> None:
        """Note [ids inside the vocabulary], (1): every split's ids in [0, the claimed vocabulary)."""
        claimed = self.known_vocab_size
        for name in self.splits:
            scanned = self.id_range(name)
            if scanned is None:
                continue
            low, high = scanned
            if low < 0:
                position, bad = first_outside(self.splits[name], 0, None)
                raise CorpusError(f"{self.files[name]}: token {position} is id {bad}, and ids are never negative: the "
                                  "file is corrupt or holds no token ids; tokenize the corpus again")
            if claimed is not None and high >= claimed:
                position, bad = first_outside(self.splits[name], 0, claimed)
                said = f"{os.path.join(self.spec.path, META_FILE)} says" if self.meta is not None \
                    else f"vocab={claimed} says"
                fix = "prepare the corpus again with its tokenizer" if self.meta is not None \
                    else f"give vocab={high + 1} or more, or drop vocab= to take the largest id + 1"
                raise CorpusError(f"{self.files[name]}: token {position} is id {bad}, but {said} the vocabulary is "
                                  f"{claimed}: {fix}")

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


def first_outside(array: np.ndarray, low: int, high: int | None) -> tuple[int, int]:
    """(position, id) of the first id outside [low, high) (``high`` None: no upper bound); the
    error path's second scan, so the message can name where the file lies."""
    for start in range(0, array.shape[0], SCAN_CHUNK_TOKENS):
        chunk = array[start:start + SCAN_CHUNK_TOKENS]
        bad = np.flatnonzero((chunk < low) | (chunk >= high) if high is not None else chunk < low)
        if bad.size:
            return start + int(bad[0]), int(chunk[bad[0]])
    raise AssertionError("first_outside: every id is inside; the caller saw one outside")


def _resolved_inside(folder: str, path: str) -> str | None:
    """``path`` with every link followed, or None when that leaves ``folder``."""
    root, real = os.path.realpath(folder), os.path.realpath(path)
    return real if os.path.commonpath([root, real]) == root else None


def inside(folder: str, name, *, named_in: str, what: str = "file") -> str:
    """``folder/name`` resolved, refused unless it stays inside ``folder`` (Note [files inside the
    corpus folder]); the resolved path is the one to open."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise CorpusError(f"{named_in}: {what} {name!r} is no file name: write the corpus again")
    real = None if os.path.isabs(name) else _resolved_inside(folder, os.path.join(folder, name))
    if real is None:
        raise CorpusError(f"{named_in}: {what} {name!r} resolves to {os.path.realpath(os.path.join(folder, name))}, "
                          f"outside {folder}: a corpus reads only the files in its folder; copy the file into the "
                          "folder, or write the corpus again")
    return real


def folder_file(folder: str, name, expected: str, *, what: str) -> str:
    """A prepared folder's own file, resolved: meta.json names exactly ``expected``, and it stays
    inside the folder (Note [files inside the corpus folder])."""
    if name != expected:
        raise CorpusError(f"{os.path.join(folder, META_FILE)}: {what} names file {name!r}, not {expected!r}: a "
                          "prepared corpus reads only its own files; prepare the corpus again")
    path = os.path.join(folder, expected)
    real = _resolved_inside(folder, path)
    if real is None:
        raise CorpusError(f"{path}: resolves to {os.path.realpath(path)}, outside {folder}: a corpus reads only the "
                          "files in its folder; copy the file into the folder, or prepare the corpus again")
    return real


def tokenizer_file(folder: str, meta: dict) -> str | None:
    """The folder's tokenizer copy (checked: Note [files inside the corpus folder]), or None for bytes."""
    tok = meta["tokenizer"]
    if tok.get("kind") == "bytes":
        return None
    return folder_file(folder, tok.get("file"), TOKENIZER_FILE, what="tokenizer")


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
        if name not in SPLIT_FILES:
            raise CorpusError(f"{os.path.join(spec.path, META_FILE)}: split {name!r} is not one of "
                              f"{', '.join(SPLIT_FILES)}: prepare the corpus again")
        path = folder_file(spec.path, entry.get("file") if isinstance(entry, dict) else None, SPLIT_FILES[name],
                           what=f"split {name!r}")
        if os.path.isfile(path) and os.path.getsize(path) != entry["bytes"]:
            raise CorpusError(f"{path}: {os.path.getsize(path)} bytes, meta.json says {entry['bytes']}: the file "
                              "is truncated or was replaced; prepare the corpus again")
        splits[name], files[name] = token_array(path, dtype), path
    return TokenSource(spec, splits, files, known_vocab_size=int(meta["vocab_size"]), meta=meta)
