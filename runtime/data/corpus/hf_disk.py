"""``hf-disk:DIR``: a ``datasets.save_to_disk`` folder (a Dataset, or a DatasetDict whose
"train" and "validation"/"val"/"test" become the splits) with an ``input_ids`` column.

Note [hf-disk in memory]: Arrow stores ``input_ids`` as list chunks, not one flat array, so each
split's token stream is concatenated once into memory at open (not a memmap, unlike the other
kinds); for a corpus larger than memory, write it once as a prepared folder or a flat .bin.
"""

from __future__ import annotations

import os

import numpy as np

from runtime.data.corpus.formats import TokenSource
from runtime.data.corpus.spec import CorpusError, CorpusSpec

VAL_NAMES = ("validation", "val", "test")


def _flat_ids(dataset, path: str) -> np.ndarray:
    if "input_ids" not in dataset.column_names:
        raise CorpusError(f"{path}: has no input_ids column (it has {', '.join(dataset.column_names)}): tokenize it "
                          "first (dataset.map(lambda r: tokenizer(r['text'])))")
    if getattr(dataset, "_indices", None) is not None:  # a select/shuffle view: make its rows real first
        dataset = dataset.flatten_indices()
    column = dataset.data.column("input_ids")
    pieces = [chunk.flatten().to_numpy(zero_copy_only=False) for chunk in column.chunks]
    ids = np.concatenate(pieces) if pieces else np.empty(0, dtype=np.int64)
    if ids.dtype.kind not in "iu":
        raise CorpusError(f"{path}: input_ids are {ids.dtype}, not integer ids: tokenize the corpus")
    return ids


def open_hf_disk(spec: CorpusSpec) -> TokenSource:
    try:
        import datasets  # lazy: optional dependency, only this kind needs it
    except ImportError:
        raise CorpusError(f"{spec.path}: hf-disk: corpora need the datasets package: pip install datasets") from None
    if not os.path.isdir(spec.path):
        raise CorpusError(f"{spec.path}: no such folder: hf-disk:DIR names a datasets.save_to_disk folder")
    loaded = datasets.load_from_disk(spec.path)
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise CorpusError(f"{spec.path}: its DatasetDict has no 'train' split (it has {', '.join(loaded)}): "
                              "save one named train")
        splits = {"train": _flat_ids(loaded["train"], spec.path)}
        val = next((name for name in VAL_NAMES if name in loaded), None)
        if val is not None:
            splits["val"] = _flat_ids(loaded[val], spec.path)
    else:
        splits = {"train": _flat_ids(loaded, spec.path)}
    return TokenSource(spec, splits, {name: spec.path for name in splits}, known_vocab_size=spec.vocab_size)
