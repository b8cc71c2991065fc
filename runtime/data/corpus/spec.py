"""What names a token corpus: the spec text (``tokens:DIR``, ``tokens:FILE.bin,dtype=uint16``,
``megatron:PREFIX``, ``hf-disk:DIR``) as the frozen ``CorpusSpec``, and ``CorpusError``, the one
error every corpus problem raises."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

KINDS = ("tokens", "megatron", "hf-disk")
TOKEN_DTYPES = ("uint16", "uint32")  # what a flat tokens file may hold (nanoGPT writes uint16)
_OPTIONS = ("dtype", "vocab")


class CorpusError(ValueError):
    """A token corpus that cannot be read as asked: missing, truncated, of the wrong dtype, with a
    bad index or checksum, or too short for the run. One line naming the file and the fix (a
    ValueError, as runtime/errors.py's are: the user's to fix, printed by the CLI as one line)."""


@dataclass(frozen=True)
class CorpusSpec:
    """``kind:PATH[,dtype=D][,vocab=V]``. ``dtype`` is required for a flat ``tokens:FILE.bin`` and
    checked against meta.json for a prepared folder; ``vocab`` gives the vocabulary where a format
    records none (a flat file, Megatron's, hf-disk's; else the largest id + 1), and the scan at
    open refuses an id at or past it (Note [ids inside the vocabulary] in formats.py)."""

    kind: str
    path: str
    dtype: str | None = None
    vocab_size: int | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise CorpusError(f"corpus kind {self.kind!r} is not one of {', '.join(KINDS)}: write e.g. tokens:DATA_DIR")
        if not self.path:
            raise CorpusError(f"corpus spec {self.kind}: names no path: write {self.kind}:PATH")
        if self.dtype is not None and self.dtype not in TOKEN_DTYPES:
            raise CorpusError(f"{self.path}: dtype={self.dtype} is not a token dtype: use one of {', '.join(TOKEN_DTYPES)}")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise CorpusError(f"{self.path}: vocab={self.vocab_size} must be a positive integer")

    @classmethod
    def parse(cls, text: str) -> "CorpusSpec":
        kind, sep, rest = text.partition(":")
        if not sep:
            raise CorpusError(f"corpus spec {text!r} has no kind: write tokens:DATA_DIR, tokens:FILE.bin,dtype=uint16, "
                              "megatron:PREFIX or hf-disk:DIR")
        path, *options = rest.split(",")
        values: dict[str, str] = {}
        for option in options:
            key, eq, value = option.partition("=")
            if not eq or key not in _OPTIONS:
                raise CorpusError(f"corpus spec {text!r}: option {option!r} is not one of "
                                  f"{', '.join(o + '=...' for o in _OPTIONS)}")
            values[key] = value
        vocab = values.get("vocab")
        if vocab is not None and not vocab.isdigit():
            raise CorpusError(f"corpus spec {text!r}: vocab={vocab} is not an integer")
        return cls(kind, path, values.get("dtype"), int(vocab) if vocab is not None else None)

    def to_text(self) -> str:
        options = ([f"dtype={self.dtype}"] if self.dtype else []) + \
            ([f"vocab={self.vocab_size}"] if self.vocab_size is not None else [])
        return ",".join([f"{self.kind}:{self.path}", *options])


def absolute_spec(text: str, base: Path | None = None) -> str:
    """The spec with its path made absolute (relative to ``base``, else the working directory):
    the ranks run from anywhere."""
    spec = CorpusSpec.parse(text)
    path = Path(spec.path).expanduser()
    if not path.is_absolute():
        path = (base or Path.cwd()) / path
    return dataclasses.replace(spec, path=str(path.resolve())).to_text()
