"""Batches of a token corpus, the runtime's two entry points:

- ``make_batch(step, global_batch, *, source, seq, seed=0, split="train")`` ->
  ``((tokens,), targets)``, both int64 [global_batch, seq]: the ``make_batch`` interface every
  program already calls (``["runtime.data.corpus.batches:make_batch", {"source": "tokens:DIR",
  "seq": 128}]`` binds through runtime/program/user_code.py's ``resolve_callable``);
- ``rows(step, global_batch, *, source, seq, rows, want, ...)``: the same batch's rows ``rows``
  only, reading only the windows (and of them only the half) those rows use: stage 0 of a replica
  wants its rows' inputs, the last stage their targets, a middle stage nothing (0 bytes read).

Both follow Note [global sample order] in runtime/data/corpus/windows.py, so any split of the rows
over ranks reassembles ``make_batch``'s batch exactly. ``vocab`` (the model's vocabulary, which the
compiler passes) bounds every id a window may hold (Note [ids inside the vocabulary] in
runtime/data/corpus/formats.py). Sources are opened once per process
(``source_for``, keyed by the canonical spec text), since both are called every step.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

from runtime.data.corpus.formats import TokenSource
from runtime.data.corpus.sources import open_source
from runtime.data.corpus.spec import CorpusError, CorpusSpec
from runtime.data.corpus.windows import num_windows, sample_windows

Want = Literal["inputs", "targets", "both"] | None
_sources: dict[str, TokenSource] = {}


def source_for(source: str | CorpusSpec | TokenSource) -> TokenSource:
    """The process's one opened source for a spec (text or parsed), or ``source`` itself."""
    if isinstance(source, TokenSource):
        return source
    spec = source if isinstance(source, CorpusSpec) else CorpusSpec.parse(source)
    key = spec.to_text()
    if key not in _sources:
        _sources[key] = open_source(spec)
    return _sources[key]


def forget_sources() -> None:
    """Drop the per-process cache (a test that rewrites a corpus in place)."""
    _sources.clear()


def check_fits(opened: TokenSource, split: str, *, seq: int, global_batch: int) -> int:
    """The split's window count, refused when one global batch of distinct windows does not fit."""
    if seq < 1 or global_batch < 1:
        raise CorpusError(f"{opened.label}: seq={seq} and global_batch={global_batch} must be positive")
    tokens = int(opened.split(split).shape[0])
    windows = num_windows(tokens, seq)
    if windows == 0:
        raise CorpusError(f"{opened.files[split]}: {tokens} tokens, shorter than one window of seq={seq} (needs "
                          f"{seq + 1}): use a longer corpus or a smaller seq")
    if windows < global_batch:
        raise CorpusError(f"{opened.files[split]}: {tokens} tokens make {windows} windows of seq={seq}, fewer than "
                          f"one global batch of {global_batch} (needs {global_batch * seq + 1} tokens): use a longer "
                          "corpus, a smaller seq or a smaller global batch")
    return windows


def _row_range(rows: range | slice, global_batch: int) -> range:
    picked = range(*rows.indices(global_batch)) if isinstance(rows, slice) else rows
    if len(picked) and (min(picked) < 0 or max(picked) >= global_batch):
        raise CorpusError(f"rows {rows} fall outside the global batch of {global_batch}: pass rows within "
                          f"range({global_batch})")
    return picked


def id_bound(opened: TokenSource, vocab: int | None) -> int:
    """The ids a window may hold lie below this: the corpus's vocabulary, and the model's when
    given, which the scanned ids are checked against (Note [ids inside the vocabulary], (2))."""
    if vocab is None:
        return opened.vocab_size
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise CorpusError(f"vocab={vocab!r}: the model's vocabulary must be a positive integer")
    top = opened.largest_id()
    if top is not None and top >= vocab:
        where = next(opened.files[n] for n in opened.splits if (opened.id_range(n) or (0, -1))[1] == top)
        raise CorpusError(f"{where}: holds id {top}, but the model embeds {vocab} ids: build the model with vocab >= "
                          f"{top + 1}, or prepare the corpus with the model's tokenizer")
    return min(vocab, opened.vocab_size)


def _check_window(opened: TokenSource, split: str, block: np.ndarray, starts: np.ndarray, bound: int) -> None:
    """Note [ids inside the vocabulary], (3): the ids just read, checked beside the read."""
    if not block.size or (int(block.max()) < bound and (block.dtype.kind != "i" or int(block.min()) >= 0)):
        return
    row, column = np.argwhere((block < 0) | (block >= bound))[0]
    bad = int(block[row, column])
    raise CorpusError(f"{opened.files[split]}: token {int(starts[row]) + int(column)} is id {bad} now, outside the "
                      f"vocabulary of {bound} checked when it was opened: the file changed while it was read; write "
                      "the corpus to a new folder, never over one a run reads, and start again")


def rows(step: int, global_batch: int, *, source: str | CorpusSpec | TokenSource, seq: int,
         rows: range | slice, want: Want = "both", seed: int = 0, split: str = "train", vocab: int | None = None):
    """``(inputs, targets)`` of the global batch's rows ``rows``: ``inputs`` is ``(tokens,)``
    [len(rows), seq] int64 when ``want`` is "inputs" or "both", else None; ``targets`` likewise
    for "targets" or "both". ``want=None`` or no rows reads nothing (a middle stage)."""
    if want not in ("inputs", "targets", "both", None):
        raise CorpusError(f"want={want!r}: use 'inputs', 'targets', 'both' or None")
    if step < 0:
        raise CorpusError(f"step={step} must be >= 0")
    opened = source_for(source)
    windows = check_fits(opened, split, seq=seq, global_batch=global_batch)
    bound = id_bound(opened, vocab)
    picked = _row_range(rows, global_batch)
    if want is None or not len(picked):
        return None, None
    samples = step * global_batch + np.asarray(picked, dtype=np.int64)
    starts = sample_windows(seed, windows, samples) * seq
    first, width = (1, seq) if want == "targets" else (0, seq + 1 if want == "both" else seq)
    tokens = opened.split(split)
    block = tokens[(starts + first)[:, None] + np.arange(width, dtype=np.int64)[None, :]]
    _check_window(opened, split, block, starts + first, bound)
    opened.stats.bytes_read += block.size * tokens.itemsize
    opened.stats.windows_read += len(picked)
    block = torch.from_numpy(block.astype(np.int64))
    if want == "inputs":
        return (block,), None
    if want == "targets":
        return None, block
    return (block[:, :-1].contiguous(),), block[:, 1:].contiguous()


def make_batch(step: int, global_batch: int, *, source: str | CorpusSpec | TokenSource, seq: int,
               seed: int = 0, split: str = "train", vocab: int | None = None):
    """``((tokens,), targets)`` of the whole global batch: ``rows`` over every row."""
    return rows(step, global_batch, source=source, seq=seq, rows=range(global_batch), want="both", seed=seed,
                split=split, vocab=vocab)


def reads() -> dict:
    """What this process's batches read, over every source it opened: bytes of token data and
    windows (a rank writes it at the end of a run: Note [a rank reads its rows])."""
    return {"bytes_read": sum(s.stats.bytes_read for s in _sources.values()),
            "windows_read": sum(s.stats.windows_read for s in _sources.values())}
