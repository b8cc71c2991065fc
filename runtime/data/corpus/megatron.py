"""Megatron-LM's indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``) read with numpy alone.

Note [megatron index layout]: the .idx, all little-endian, as megatron/core/datasets/
indexed_dataset.py writes it (``_IndexWriter``; checked against NVIDIA/Megatron-LM d98e8a6):

    9 bytes   magic b"MMIDIDX\\x00\\x00"
    u64       version, 1
    u8        dtype code of the .bin's tokens (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
              6 float64, 7 float32, 8 uint16)
    u64       S, the number of sequences;  u64  D, the number of document indices
    int32[S]  sequence lengths in tokens
    int64[S]  sequence pointers: byte offsets into the .bin
    int64[D]  document indices: sequence numbers, 0 first, S last (the builder starts with [0])
    int8[S]   sequence modes, multimodal datasets only

The builder writes sequences back to back, so the token stream is the .bin's first
sum(lengths) tokens in order; we read it as one flat memmap and refuse an index whose pointers
are not contiguous, or whose end is not the .bin's size (documents carry their EOD if the user's
preprocessing appended one). Megatron's files hold one split: the source has "train" only.
"""

from __future__ import annotations

import os
import struct

import numpy as np

from runtime.data.corpus.formats import TokenSource, token_array
from runtime.data.corpus.spec import CorpusError, CorpusSpec

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = 34
TOKEN_CODES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 8: "uint16"}
FLOAT_CODES = {6: "float64", 7: "float32"}


def prefix_of(path: str) -> str:
    """``PREFIX``, ``PREFIX.bin`` or ``PREFIX.idx`` -> PREFIX (users paste either file's name)."""
    root, ext = os.path.splitext(path)
    return root if ext in (".bin", ".idx") else path


def read_index(idx_path: str) -> tuple[str, np.ndarray, np.ndarray, np.ndarray]:
    """(token dtype, lengths, pointers, document indices) of one .idx, its shape checked."""
    if not os.path.isfile(idx_path):
        raise CorpusError(f"{idx_path}: no such file: megatron:PREFIX needs PREFIX.idx beside PREFIX.bin")
    size_bytes = os.path.getsize(idx_path)
    with open(idx_path, "rb") as f:
        header = f.read(HEADER_BYTES)
    if len(header) < HEADER_BYTES or header[:9] != MAGIC:
        raise CorpusError(f"{idx_path}: not a Megatron index (its first bytes are not {MAGIC!r}): name the "
                          "prefix of a .bin/.idx pair written by Megatron's preprocess_data.py")
    version, code, sequences, documents = struct.unpack("<QBQQ", header[9:])
    if version != VERSION:
        raise CorpusError(f"{idx_path}: Megatron index version {version}, this reader knows {VERSION}: "
                          "write the index again with Megatron-LM's core datasets")
    if code in FLOAT_CODES:
        raise CorpusError(f"{idx_path}: its tokens are {FLOAT_CODES[code]}, not integer ids: index a tokenized corpus")
    if code not in TOKEN_CODES:
        raise CorpusError(f"{idx_path}: unknown dtype code {code}: not a Megatron index this reader knows")
    plain = HEADER_BYTES + 12 * sequences + 8 * documents
    if size_bytes not in (plain, plain + sequences):
        raise CorpusError(f"{idx_path}: {size_bytes} bytes, but its header ({sequences} sequences, {documents} "
                          f"document indices) needs {plain}: the index is truncated or corrupt; write it again")
    lengths = np.fromfile(idx_path, dtype="<i4", count=sequences, offset=HEADER_BYTES)
    pointers = np.fromfile(idx_path, dtype="<i8", count=sequences, offset=HEADER_BYTES + 4 * sequences)
    document_indices = np.fromfile(idx_path, dtype="<i8", count=documents, offset=HEADER_BYTES + 12 * sequences)
    return TOKEN_CODES[code], lengths, pointers, document_indices


def open_megatron(spec: CorpusSpec) -> TokenSource:
    """PREFIX.bin + PREFIX.idx as the train split; a PREFIX_val.bin + PREFIX_val.idx pair beside
    them, when both exist, as the validation split (Megatron keeps validation in its own dataset,
    its --valid-data-path)."""
    prefix = prefix_of(spec.path)
    tokens, bin_path = _read_pair(prefix, spec)
    splits, files = {"train": tokens}, {"train": bin_path}
    if os.path.isfile(prefix + "_val.bin") and os.path.isfile(prefix + "_val.idx"):
        splits["val"], files["val"] = _read_pair(prefix + "_val", spec)
    return TokenSource(spec, splits, files, known_vocab_size=spec.vocab_size)


def _read_pair(prefix: str, spec: CorpusSpec):
    """(tokens as one memmapped stream, the .bin's path) of one .bin/.idx pair, checked."""
    bin_path, idx_path = prefix + ".bin", prefix + ".idx"
    if not os.path.isfile(bin_path):
        raise CorpusError(f"{bin_path}: no such file: megatron:PREFIX reads PREFIX.bin and PREFIX.idx")
    dtype, lengths, pointers, documents = read_index(idx_path)
    if spec.dtype is not None and spec.dtype != dtype:
        raise CorpusError(f"{spec.path}: dtype={spec.dtype} but {idx_path} says {dtype}: drop the dtype= option")
    itemsize = np.dtype(dtype).itemsize
    starts = np.concatenate([[0], np.cumsum(lengths.astype(np.int64) * itemsize)])
    if (lengths < 0).any() or not np.array_equal(pointers, starts[:-1]):
        raise CorpusError(f"{idx_path}: its sequence pointers are not back to back from 0: not an index this "
                          "reader takes as one token stream; write it again with Megatron's builder")
    if documents.shape[0] and (documents[0] != 0 or documents[-1] != lengths.shape[0] or (np.diff(documents) < 0).any()):
        raise CorpusError(f"{idx_path}: its document indices do not run from 0 to its {lengths.shape[0]} sequences: "
                          "the index is corrupt; write it again")
    end_bytes, size_bytes = int(starts[-1]), os.path.getsize(bin_path)
    if size_bytes != end_bytes:
        raise CorpusError(f"{bin_path}: {size_bytes} bytes, but {idx_path}'s sequences end at byte {end_bytes}: "
                          "the .bin is truncated or belongs to another index; write the pair again")
    return token_array(bin_path, dtype, count=end_bytes // itemsize), bin_path
