"""``open_source(spec)``: one parsed spec opened as a ``TokenSource``, by its kind (the readers
are formats.py's, megatron.py's and hf_disk.py's; hf_disk imports ``datasets`` only when used),
its ids scanned (Note [ids inside the vocabulary] in runtime/data/corpus/formats.py)."""

from __future__ import annotations

import os

from runtime.data.corpus.formats import TokenSource, open_flat, open_prepared
from runtime.data.corpus.hf_disk import open_hf_disk
from runtime.data.corpus.megatron import open_megatron
from runtime.data.corpus.spec import CorpusSpec


def open_source(spec: CorpusSpec) -> TokenSource:
    if spec.kind == "megatron":
        source = open_megatron(spec)
    elif spec.kind == "hf-disk":
        source = open_hf_disk(spec)
    elif os.path.isdir(spec.path):
        source = open_prepared(spec)
    else:
        source = open_flat(spec)
    source.check_ids()
    return source
