"""Text to token ids and back for `partitioner generate`: the tokenizer of the data a program
trained on (a prepared corpus folder's meta.json, runtime/data/corpus/prepare.py), or bytes.

Note [where the tokenizer comes from]: ``--tokenizer-from DATA_DIR`` (a prepared corpus folder, or
``tokens:DATA_DIR``) names it outright, for a program trained on its own make_batch. Otherwise the
program's ``data.make_batch`` says: a ``source`` keyword that is ``tokens:`` a prepared folder (what
compile's ``--data tokens:DIR`` writes) has its meta.json's tokenizer (bytes, or the tokenizer.json
copied into the folder). A source that records no tokenizer (a flat .bin, megatron:, hf-disk:) is
refused: bytes would decode a BPE corpus into nonsense that looks like a bad model. No source at all
means synthetic tokens: bytes then, when the model has the 256 ids they need, with one note that
the text is noise (the model learnt random ids; the command still shows the whole path works).

Note [sampling within the tokenizer's vocabulary]: a model's vocabulary is often larger than its
tokenizer's (gpt:vocab=257 trained on bytes, Megatron's padded 50304 for GPT-2's 50257). Ids past
the tokenizer's have no text; they are never drawn, so every sampled id decodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from runtime.data.corpus import META_FILE, CorpusSpec
from runtime.data.corpus.formats import read_meta, tokenizer_file
from runtime.data.corpus.prepare import BYTE_VOCAB, decode, load_tokenizer


@dataclass(frozen=True)
class TextCodec:
    """``kind`` "bytes" (ids = UTF-8 bytes) or "huggingface" (``tokenizer_file``, a tokenizer.json).
    ``meta_dir``: the prepared corpus folder it is of (None: bytes for a synthetic-token program)."""

    kind: str
    vocab_size: int
    eod_id: int | None = None
    meta_dir: str | None = None
    tokenizer_file: str | None = None
    sha256: str | None = None

    @property
    def what(self) -> str:
        return f"{self.meta_dir}'s tokenizer" if self.meta_dir else "the byte tokenizer"

    def encode(self, text: str) -> list[int]:
        if self.kind == "bytes":
            return list(text.encode("utf-8"))
        info, encode = load_tokenizer(self.tokenizer_file, append_eod=False)
        if info.sha256 != self.sha256:
            raise ValueError(f"{self.tokenizer_file}: not the tokenizer {self.meta_dir} was prepared with (sha256 "
                             f"{str(self.sha256)[:12]}...): prepare the corpus again")
        return [int(i) for i in encode(text)]

    def decode(self, ids) -> str:
        if self.meta_dir is not None:
            return decode(list(ids), self.meta_dir)
        return bytes(ids).decode("utf-8", errors="replace")

    def continuation(self, prompt_ids, new_ids) -> str:
        """The text of ``new_ids`` after the prompt: decoded together with it, so a tokenizer that
        marks word starts (a leading space) decodes the first new token as it would mid-text."""
        whole, head = self.decode(list(prompt_ids) + list(new_ids)), self.decode(prompt_ids)
        return whole[len(head):] if whole.startswith(head) else self.decode(new_ids)

    def check_fits(self, ids, prompt: str, model_vocab: int) -> None:
        """Every prompt id is one the model has (an embedding lookup past it would crash or read garbage)."""
        bad = next((i for i in ids if not 0 <= i < model_vocab), None)
        if bad is not None:
            raise ValueError(f"--prompt {prompt!r}: {self.what} encodes it to token id {bad} ({self.decode([bad])!r}), "
                             f"outside the model's vocabulary of {model_vocab} (the tokenizer has {self.vocab_size}): "
                             "prompt with text in the model's vocabulary, or pass --tokenizer-from the corpus it "
                             "trained on")


def make_batch_kwargs(make_batch) -> dict:
    """The keyword arguments of a callable spec ("pkg.mod:fn" or ["pkg.mod:fn", {kwargs}])."""
    if isinstance(make_batch, (list, tuple)) and len(make_batch) > 1 and isinstance(make_batch[1], dict):
        return make_batch[1]
    return {}


def corpus_source(make_batch) -> str | None:
    """make_batch's ``source`` keyword (runtime.data.corpus.batches:make_batch's), or None."""
    source = make_batch_kwargs(make_batch).get("source")
    return source if isinstance(source, str) else None


def codec_of_folder(folder: str) -> TextCodec:
    """The tokenizer a prepared corpus folder records in its meta.json."""
    meta = read_meta(folder)
    tok = meta["tokenizer"]
    if tok["kind"] == "bytes":
        return TextCodec("bytes", meta["vocab_size"], meta["eod_id"], folder)
    file = tokenizer_file(folder, meta)  # Note [files inside the corpus folder] in runtime/data/corpus/formats.py
    return TextCodec("huggingface", meta["vocab_size"], meta["eod_id"], folder, file, tok["sha256"])


def _folder_of(text: str) -> str:
    """``--tokenizer-from``: a prepared folder, with or without ``tokens:``."""
    folder = text.removeprefix("tokens:")
    if not (Path(folder) / META_FILE).is_file():
        raise ValueError(f"--tokenizer-from {text}: no {META_FILE} in {folder}: pass a prepared corpus folder "
                         "(`partitioner data prepare FILE... -o DATA_DIR --tokenizer ...` writes one)")
    return folder


def codec_for(make_batch, tokenizer_from: str | None, model_vocab: int) -> tuple[TextCodec, tuple[str, ...]]:
    """(the tokenizer, notes for stderr) of a program whose data is ``make_batch`` (Note [where the
    tokenizer comes from])."""
    if tokenizer_from:
        return codec_of_folder(_folder_of(tokenizer_from)), ()
    source = corpus_source(make_batch)
    if source is not None:
        spec = CorpusSpec.parse(source)
        if spec.kind == "tokens" and (Path(spec.path) / META_FILE).is_file():
            return codec_of_folder(spec.path), ()
        raise ValueError(f"the program trained on {source}, which records no tokenizer: pass --tokenizer-from "
                         "DATA_DIR, a prepared corpus folder of the same tokenizer")
    name = make_batch if isinstance(make_batch, str) else make_batch[0]
    if model_vocab < BYTE_VOCAB:
        raise ValueError(f"the program trained on synthetic tokens ({name}) and its model's vocabulary of {model_vocab} "
                         f"is under the {BYTE_VOCAB} byte ids: pass --tokenizer-from DATA_DIR, a prepared corpus folder")
    return TextCodec("bytes", BYTE_VOCAB), (
        f"the program trained on synthetic tokens ({name}), so the text is noise; it is decoded as bytes "
        "(--tokenizer-from DATA_DIR names a corpus's tokenizer)",)
