"""``hf-disk:DIR``: a ``datasets.save_to_disk`` folder (a Dataset, or a DatasetDict whose
"train" and "validation"/"val"/"test" become the splits) with an ``input_ids`` column.

Note [hf-disk in memory]: Arrow stores ``input_ids`` as list chunks, not one flat array, so each
split's token stream is concatenated once into memory at open (not a memmap, unlike the other
kinds); for a corpus larger than memory, write it once as a prepared folder or a flat .bin.

Before ``datasets`` reads the folder, the files its metadata names are checked to stay inside it
(``check_names``: Note [files inside the corpus folder] in runtime/data/corpus/formats.py):
datasets joins state.json's "_data_files" names and dataset_dict.json's "splits" to the folder
unchecked, so an absolute name or ``..`` would read any file.
"""

from __future__ import annotations

import json
import os

import numpy as np

from runtime.data.corpus.formats import TokenSource, inside
from runtime.data.corpus.spec import CorpusError, CorpusSpec

VAL_NAMES = ("validation", "val", "test")
STATE_FILE, DICT_FILE = "state.json", "dataset_dict.json"  # what datasets.save_to_disk names them


def _json_of(folder: str, name: str):
    path = inside(folder, name, named_in=folder)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CorpusError(f"{os.path.join(folder, name)}: unreadable ({exc.__class__.__name__}): save the dataset "
                          "again with datasets' save_to_disk") from None


def _check_state(folder: str) -> None:
    """One saved Dataset's data files, each inside its folder."""
    if not os.path.isfile(os.path.join(folder, STATE_FILE)):
        return  # datasets says what is missing
    state, where = _json_of(folder, STATE_FILE), os.path.join(folder, STATE_FILE)
    files = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(files, list) or not all(isinstance(f, dict) for f in files):
        raise CorpusError(f"{where}: its _data_files is not a list of files: save the dataset again with save_to_disk")
    for entry in files:
        inside(folder, entry.get("filename"), named_in=where, what="data file")


def check_names(folder: str) -> None:
    """Every file a saved Dataset or DatasetDict names resolves inside ``folder``."""
    _check_state(folder)
    if os.path.isfile(os.path.join(folder, DICT_FILE)):
        listed, where = _json_of(folder, DICT_FILE), os.path.join(folder, DICT_FILE)
        splits = listed.get("splits") if isinstance(listed, dict) else None
        if not isinstance(splits, list):
            raise CorpusError(f"{where}: its splits is not a list of names: save the dataset again with save_to_disk")
        for split in splits:
            _check_state(inside(folder, split, named_in=where, what="split"))


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
    if os.path.isdir(spec.path):
        check_names(spec.path)  # before datasets reads a name
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
