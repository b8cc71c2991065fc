"""The on-disk token corpus a run trains on: open a source read-only as flat token arrays, cut
causal-LM windows in a layout-independent order, hand each rank the rows (and only the bytes) it
needs. Imports torch, numpy and the standard library only (``datasets`` lazily, for hf-disk:);
never the compiler. prepare.py writes the prepared folder the others read (the format's writer
beside its reader).

Rooms
-----
spec.py       ``CorpusSpec`` (``parse(text)``, ``to_text()``: ``tokens:DIR``,
              ``tokens:FILE.bin,dtype=uint16``, ``megatron:PREFIX``, ``hf-disk:DIR``) and
              ``CorpusError``, the one error of every corpus problem
formats.py    ``TokenSource`` (splits as memmaps, ``vocab_size``, ``num_tokens``, ``verify()``, the id
              scan: Note [ids inside the vocabulary]), ``ReadStats``; the prepared folder's layout
              and reader, the flat file's; ``inside`` (Note [files inside the corpus folder])
sources.py    ``open_source(spec)``: the dispatch on the kind
megatron.py   Megatron-LM's .bin/.idx pair read with numpy (Note [megatron index layout])
hf_disk.py    a ``datasets.save_to_disk`` folder's ``input_ids`` (Note [hf-disk in memory])
windows.py    windows of seq + 1 tokens, one seeded permutation per epoch (Notes [global sample
              order], [permutation per epoch])
prepare.py    text or JSONL tokenized (bytes or a local tokenizer.json) into a prepared folder,
              atomically; ``decode`` (torch-free; `partitioner data prepare`)
batches.py    ``make_batch`` (the program's interface) and ``rows`` (one rank's rows, inputs or
              targets or nothing), the per-process source cache ``source_for``; the one room that
              imports torch, so it is not re-exported here: import ``runtime.data.corpus.batches``
              (the compile side's prepare and ``partitioner data`` stay torch-free)
"""

from runtime.data.corpus.formats import META_FILE, META_FORMAT, META_VERSION, SPLIT_FILES, ReadStats, TokenSource
from runtime.data.corpus.sources import open_source
from runtime.data.corpus.spec import TOKEN_DTYPES, CorpusError, CorpusSpec
from runtime.data.corpus.windows import epoch_permutation, num_windows, sample_windows

__all__ = [
    "META_FILE", "META_FORMAT", "META_VERSION", "SPLIT_FILES", "TOKEN_DTYPES", "CorpusError", "CorpusSpec", "ReadStats",
    "TokenSource", "epoch_permutation", "num_windows", "open_source", "sample_windows",
]
