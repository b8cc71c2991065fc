"""``partitioner data prepare``: text and JSONL files tokenized into a prepared corpus folder
(train.bin, val.bin, meta.json: the layout runtime/data/corpus/formats.py documents and reads), and
``decode``, its ids back to text.

Note [validation split by documents]: the validation split is the last ``val_fraction`` of the
documents, in input order (at least one when there are two or more, and never all of them), so it
is deterministic and no document straddles the two splits; a single document is split by tokens
instead (its last ``val_fraction``). Documents are counted in a first cheap pass, so the second
streams each one to its split's file without holding the corpus.

Note [atomic corpus folder]: everything is written into a temporary folder beside ``out_dir``,
each file fsync'd, then the folder renamed into place and its parent fsync'd: a failure at any
point leaves no ``out_dir`` (and, with ``overwrite``, the old one intact until the new one is complete).

Note [vocabulary is the largest id + 1]: a tokenizer's ids need not be dense (added tokens placed
at 70000 in a 3-entry vocabulary), so the vocabulary recorded, and the dtype chosen from it, is
its largest id + 1, never its entry count: counting entries chose uint16 and wrote id 70000 as
4464. Every id is checked against both before the narrowing cast (``_SplitWriter.write``), so an
id the tokenizer gives outside them fails naming the input file instead of wrapping.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from runtime import scratch
from runtime.data.corpus.formats import (META_FILE, META_FORMAT, META_VERSION, SPLIT_FILES, TOKENIZER_FILE, read_meta,
                                         tokenizer_file)
from runtime.data.corpus.spec import CorpusError
from runtime.errors import DiskFullError, is_no_space

BYTE_VOCAB = 256
EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")  # tried when no tokenizer_config names one
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class TokenizerInfo:
    """What prepare records of a tokenizer. ``kind`` "bytes" (ids = UTF-8 bytes) or
    "huggingface" (``path``: its tokenizer.json). ``eod_id``: its end-of-document id, or None."""

    kind: str
    path: str | None
    sha256: str | None
    vocab_size: int
    eod_id: int | None

    @property
    def dtype(self) -> str:
        return "uint16" if self.vocab_size <= 1 << 16 else "uint32"


def fsync_dir(path: str) -> None:
    """A folder's entries made durable (runtime.resilience.checkpoint's twin would import torch here)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _sha256_once(path: str) -> str:
    """The file's sha256, hashed once per process while its size and mtime stay (decode's check)."""
    stat = os.stat(path)
    return _sha256_cached(os.path.abspath(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _sha256_cached(path: str, size_bytes: int, mtime_ns: int) -> str:
    return _sha256_file(path)


@functools.lru_cache(maxsize=4)
def _hf_tokenizer(path: str, sha256: str):
    """A tokenizer.json loaded once per (file, content) (decode runs per generated sample)."""
    from tokenizers import Tokenizer  # lazy: only the huggingface kind needs it

    return Tokenizer.from_file(path)


def _eod_of(tokenizer, folder: Path) -> int | None:
    config = folder / "tokenizer_config.json"
    names = list(EOD_CANDIDATES)
    if config.is_file():
        try:
            body = json.loads(config.read_bytes())
        except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, or nested past the parser
            why = exc.msg if isinstance(exc, json.JSONDecodeError) else "not UTF-8 JSON"
            raise CorpusError(f"--tokenizer: {config}: not JSON ({why}): fix or remove it (prepare reads "
                              "only its eos_token)") from None
        if not isinstance(body, dict):
            raise CorpusError(f"--tokenizer: {config}: a JSON {type(body).__name__}, not an object: fix or remove "
                              "it (prepare reads only its eos_token)")
        eos = body.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str):
            names.insert(0, eos)
    return next((tokenizer.token_to_id(n) for n in names if tokenizer.token_to_id(n) is not None), None)


def load_tokenizer(name: str, *, append_eod: bool) -> tuple[TokenizerInfo, Callable[[str | bytes], np.ndarray]]:
    """``bytes``, a folder holding tokenizer.json, or the file itself -> (its info, encode)."""
    if name == "bytes":
        eod = BYTE_VOCAB if append_eod else None
        info = TokenizerInfo("bytes", None, None, BYTE_VOCAB + (1 if append_eod else 0), eod)
        return info, lambda payload: np.frombuffer(
            payload if isinstance(payload, bytes) else payload.encode("utf-8"), dtype=np.uint8)
    path = Path(name)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise CorpusError(f"--tokenizer {name}: no such file{' (no tokenizer.json in it)' if path.is_dir() else ''}: "
                          "pass `bytes`, a folder holding tokenizer.json, or the tokenizer.json file")
    sha = _sha256_file(str(file))
    try:
        tokenizer = _hf_tokenizer(str(file.resolve()), sha)
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception on a bad file
        raise CorpusError(f"--tokenizer {file}: not a tokenizers tokenizer.json ({str(exc).splitlines()[0]}): "
                          "save one with Tokenizer.save or a transformers tokenizer's save_pretrained") from None
    eod = _eod_of(tokenizer, file.parent)
    if append_eod and eod is None:
        raise CorpusError(f"--append-eod: {file} has no end-of-text token ({', '.join(EOD_CANDIDATES)}, or "
                          "tokenizer_config.json's eos_token): drop --append-eod, or add such a token")
    ids = tokenizer.get_vocab(with_added_tokens=True).values()
    if not ids or min(ids) < 0:
        raise CorpusError(f"--tokenizer {file}: its vocabulary is empty or holds a negative id: use a tokenizer "
                          "whose ids start at 0")
    info = TokenizerInfo("huggingface", str(file.resolve()), sha, max(ids) + 1,  # Note [vocabulary is the largest id + 1]
                         eod if append_eod else None)

    def encode(payload: str | bytes) -> np.ndarray:
        text = payload.decode("utf-8") if isinstance(payload, bytes) else payload
        return np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)
    return info, encode


# ---- documents ---------------------------------------------------------------------------------

def _is_jsonl(path: str) -> bool:
    return path.endswith(".jsonl")


def _count_documents(path: str) -> int:
    if not _is_jsonl(path):
        return 1
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def _documents(path: str, json_key: str) -> Iterator[tuple[str | bytes, int]]:
    """(document, bytes of the file it consumed): the whole file, or a JSONL line's field."""
    with open(path, "rb") as f:
        if not _is_jsonl(path):
            data = f.read()
            yield data, len(data)
            return
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CorpusError(f"{path}:{number}: not JSON ({exc.msg}): fix the line, or pass the file "
                                  "without the .jsonl suffix to read it as one text document") from None
            except UnicodeDecodeError as exc:
                raise CorpusError(f"{path}:{number}: not UTF-8 (byte {line[exc.start]:#04x} at column "
                                  f"{exc.start + 1}): JSON Lines are UTF-8 text; re-encode the file, e.g. "
                                  "iconv -f latin1 -t utf-8") from None
            except RecursionError:
                raise CorpusError(f"{path}:{number}: nested deeper than the JSON reader goes: a document is an "
                                  f"object with a string field {json_key!r}; fix the line") from None
            text = record.get(json_key) if isinstance(record, dict) else None
            if not isinstance(text, str):
                keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
                raise CorpusError(f"{path}:{number}: no string field {json_key!r} (it has {keys}): pass "
                                  "--json-key NAME")
            yield text, len(line)


class _SplitWriter:
    """One split's .bin, streamed: bytes hashed as written, fsync'd at close. ``vocab`` bounds the
    ids (the dtype's range when None)."""

    def __init__(self, path: str, dtype: str, vocab: int | None = None):
        self.path, self.dtype, self.vocab = path, dtype, vocab
        self.bound = min(vocab or 1 << 64, int(np.iinfo(dtype).max) + 1)
        self.file = open(path, "wb")
        self.digest = hashlib.sha256()
        self.num_tokens = self.num_documents = 0

    def write(self, ids: np.ndarray, *, documents: int, origin: str) -> None:
        """``ids`` of the input file ``origin``, each checked before the narrowing cast (Note
        [vocabulary is the largest id + 1])."""
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.bound):
            bad = int(ids[(ids < 0) | (ids >= self.bound)][0])
            why = "a negative id" if bad < 0 else f"which {self.dtype} cannot hold" \
                if bad > np.iinfo(self.dtype).max else f"at or past its vocabulary of {self.vocab}"
            raise CorpusError(f"{origin}: the tokenizer gave id {bad}, {why}: its ids and its vocabulary disagree; "
                              "use a tokenizer whose ids lie in [0, its largest id]")
        data = np.ascontiguousarray(ids, dtype=np.dtype(self.dtype).newbyteorder("<")).tobytes()
        self.file.write(data)
        self.digest.update(data)
        self.num_tokens += int(ids.shape[0])
        self.num_documents += documents

    def close(self) -> dict:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        return {"file": os.path.basename(self.path), "num_tokens": self.num_tokens, "num_documents": self.num_documents,
                "bytes": os.path.getsize(self.path), "sha256": self.digest.hexdigest()}


def _val_documents(num_documents: int, val_fraction: float) -> int:
    """Note [validation split by documents]."""
    if num_documents < 2 or val_fraction == 0:
        return 0
    return min(num_documents - 1, max(1, round(num_documents * val_fraction)))


# ---- prepare -----------------------------------------------------------------------------------

def _check_inputs(files: list[str], out_dir: Path, overwrite: bool, val_fraction: float) -> None:
    if not files:
        raise CorpusError("no input files: pass one or more text or .jsonl files")
    if not 0 <= val_fraction < 1:
        raise CorpusError(f"--val-fraction {val_fraction}: must be in [0, 1) (e.g. 0.005)")
    for file in files:
        if not os.path.isfile(file):
            raise CorpusError(f"{file}: no such file: pass text or .jsonl files")
    if out_dir.exists():
        if not overwrite:
            raise CorpusError(f"{out_dir}: already exists: choose another -o, or pass --overwrite to replace it")
        if not (out_dir / META_FILE).is_file():
            raise CorpusError(f"{out_dir}: exists and is no prepared corpus (no meta.json): --overwrite replaces "
                              "only a corpus folder; choose another -o")
        inside = [f for f in files if Path(f).resolve().is_relative_to(out_dir.resolve())]
        if inside:
            raise CorpusError(f"{inside[0]}: is inside {out_dir}, which --overwrite would delete: write elsewhere")


def _write_splits(tmp: str, files: list[str], info: TokenizerInfo, encode, *, json_key: str, val_fraction: float,
                  progress: Progress | None) -> tuple[dict, list[dict], str]:
    counts = [_count_documents(f) for f in files]
    total_documents = sum(counts)
    if total_documents == 0:
        raise CorpusError(f"{files[0]}: the inputs hold no documents (empty .jsonl files): pass files with text")
    first_val = total_documents - _val_documents(total_documents, val_fraction)
    writers = {name: _SplitWriter(os.path.join(tmp, SPLIT_FILES[name]), info.dtype, info.vocab_size)
               for name in SPLIT_FILES}
    eod = np.asarray([info.eod_id], dtype=np.int64) if info.eod_id is not None else None
    total_bytes = sum(os.path.getsize(f) for f in files)
    done_bytes = index = 0
    sources = []
    try:
        for file, count in zip(files, counts):
            for document, consumed in _documents(file, json_key):
                try:
                    ids = encode(document)
                except UnicodeDecodeError as exc:  # a text file for a tokenizer of text (bytes take any byte)
                    raise CorpusError(f"{file}: not UTF-8 (byte {document[exc.start]:#04x} at offset {exc.start}): "
                                      f"--tokenizer {info.path} reads text; re-encode the file (iconv -t utf-8) or "
                                      "use --tokenizer bytes") from None
                if eod is not None:
                    ids = np.concatenate([ids, eod])
                if total_documents == 1:
                    keep = ids.shape[0] - (max(1, round(ids.shape[0] * val_fraction)) if val_fraction else 0)
                    keep = max(keep, min(1, ids.shape[0]))
                    writers["train"].write(ids[:keep], documents=1, origin=file)
                    writers["val"].write(ids[keep:], documents=0, origin=file)
                else:
                    writers["train" if index < first_val else "val"].write(ids, documents=1, origin=file)
                index += 1
                done_bytes += consumed
                if progress is not None:
                    progress(done_bytes, total_bytes)
            sources.append({"path": str(Path(file).resolve()), "bytes": os.path.getsize(file), "documents": count})
    finally:
        splits = {name: writer.close() for name, writer in writers.items()}
    return splits, sources, "tokens" if total_documents == 1 else "documents"


def prepare(files: list[str], out_dir: str, *, tokenizer: str = "bytes", json_key: str = "text",
            val_fraction: float = 0.005, append_eod: bool = False, overwrite: bool = False,
            progress: Progress | None = None) -> dict:
    """Tokenize ``files`` (text: one document per file; ``.jsonl``: one per line, field
    ``json_key``) into ``out_dir`` (Notes [validation split by documents], [atomic corpus
    folder]); returns the meta.json written."""
    files = [str(f) for f in files]
    out = Path(out_dir)
    _check_inputs(files, out, overwrite, val_fraction)
    info, encode = load_tokenizer(tokenizer, append_eod=append_eod)
    parent = out.resolve().parent
    if parent.exists() and not parent.is_dir():
        raise CorpusError(f"{out}: {parent} is a file, not a folder: name an output folder elsewhere")
    try:
        parent.mkdir(parents=True, exist_ok=True)  # like -o anywhere else: the folders on the way are made
        _sweep(parent, out.name)
        tmp, lock = scratch.make_scratch(str(parent), f".{out.name}.partial-")
    except OSError as exc:
        raise CorpusError(f"-o {out}: cannot write a folder in {parent} ({exc.strerror or exc}): pass -o DATA_DIR "
                          "in a folder you can write") from None
    try:
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would make a shared corpus readable by its owner only
        splits, sources, split_by = _write_splits(tmp, files, info, encode, json_key=json_key,
                                                  val_fraction=val_fraction, progress=progress)
        if splits["train"]["num_tokens"] == 0:
            more = f" (and {len(files) - 1} more)" if len(files) > 1 else ""
            raise CorpusError(f"{files[0]}{more}: the inputs hold no text (0 tokens): a corpus needs tokens to train "
                              "on; pass files with text")
        if info.path is not None:
            shutil.copyfile(info.path, os.path.join(tmp, TOKENIZER_FILE))
            with open(os.path.join(tmp, TOKENIZER_FILE), "rb+") as f:
                os.fsync(f.fileno())
        meta = {"format": META_FORMAT, "version": META_VERSION, "vocab_size": info.vocab_size, "dtype": info.dtype,
                "tokenizer": {"kind": info.kind, "path": info.path, "sha256": info.sha256,
                              "file": TOKENIZER_FILE if info.path else None},
                "eod_id": info.eod_id, "split_by": split_by, "val_fraction": val_fraction, "json_key": json_key,
                "splits": splits, "sources": sources}
        with open(os.path.join(tmp, META_FILE), "w") as f:
            json.dump(meta, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
        _swap_into_place(tmp, out)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_no_space(exc) or getattr(exc, "errno", None) == errno.EFBIG:
            raise DiskFullError(f"-o {out}: {exc.strerror} writing the corpus in {parent} (nothing was kept): "
                                f"free space there (or raise the quota, or ulimit -f), or pass -o DATA_DIR on a "
                                "disk with room") from None
        raise
    finally:
        scratch.release(lock)
    return meta


def _sweep(parent: Path, name: str) -> None:
    """Scratch folders of earlier runs for the same -o that were killed (Note [abandoned scratch
    folders] in runtime/scratch.py); an ``old`` one only once its replacement is in place."""
    scratch.sweep_abandoned(str(parent), f".{name}.partial-")
    if (parent / name / META_FILE).is_file():
        scratch.sweep_abandoned(str(parent), f".{name}.old-")


def _swap_into_place(tmp: str, out: Path) -> None:
    """Rename the finished folder in; an old one goes only after (Note [atomic corpus folder])."""
    old = None
    if out.exists():
        old = tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.resolve().parent)
        os.rename(out, os.path.join(old, out.name))
    os.rename(tmp, out)
    fsync_dir(str(out.resolve().parent))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ---- decode ------------------------------------------------------------------------------------

def decode(ids, meta_dir: str, *, eod_text: str = "") -> str:
    """Token ids of the corpus in ``meta_dir`` back to text; each EOD id becomes ``eod_text``."""
    meta = read_meta(meta_dir)
    ids = [int(i) for i in np.asarray(ids).reshape(-1)]
    bad = next((i for i in ids if not 0 <= i < meta["vocab_size"]), None)
    if bad is not None:
        raise CorpusError(f"id {bad} is outside {meta_dir}'s vocabulary of {meta['vocab_size']}: decode ids of this corpus")
    eod = meta["eod_id"]
    pieces, current = [], []
    for i in ids + [None]:
        if i is None or i == eod:
            pieces.append(current)
            current = []
        else:
            current.append(i)
    tok = meta["tokenizer"]
    if tok["kind"] == "bytes":
        texts = [bytes(piece).decode("utf-8", errors="replace") for piece in pieces]
    else:
        copy = tokenizer_file(meta_dir, meta)  # Note [files inside the corpus folder] in formats.py
        if not os.path.isfile(copy) or _sha256_once(copy) != tok["sha256"]:
            raise CorpusError(f"{copy}: missing or not the tokenizer {meta_dir} was prepared with (sha256 "
                              f"{tok['sha256'][:12]}...): prepare the corpus again")
        tokenizer = _hf_tokenizer(os.path.abspath(copy), tok["sha256"])
        texts = [tokenizer.decode(piece, skip_special_tokens=False) for piece in pieces]
    return eod_text.join(texts)
