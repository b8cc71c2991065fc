"""The shard: one rank's state as bytes, the one writer and the one reader of that format for the
disk and the memory tier alike.

Note [checkpoint format]: one checkpoint is one global step (``step`` = steps done = the next
step's make_batch index) in its own directory::

    CKPT/step_000000042/shard_rank_00003.safetensors   rank 3's shard (one file per rank)
    CKPT/step_000000042/manifest.json                  the commit record, written last

A shard is a safetensors file: tensors "param/<name>", "optim/<name>/exp_avg",
"optim/<name>/exp_avg_sq", "buffer/<name>" (original names, so any partition can read them;
buffers are those the forward updates, Note [mutable buffers] in partitioner/codegen/split.py),
"rng/torch_cpu", "rng/cuda_<i>", "rng/numpy_keys"; its metadata "meta" is JSON: format, step,
rank, stages, replica, plan_hash, model_fingerprint, params (names), buffers (names), param_steps
(AdamW step per parameter), lr_scheduler (LambdaLR's JSON-able state), python_random,
numpy_random. ``runtime.resilience.checkpoint.state.state_entries`` is the one definition of a shard's
contents; the manifest is runtime/resilience/checkpoint/manifest.py's.

One layout, ``ShardLayout``: the safetensors header (JSON), then every tensor's raw bytes, largest
element size first, the data 64-byte aligned. The disk writes it as a header followed by the
snapshot's own tensor buffers (``shard_pieces``, streamed by
``runtime.resilience.checkpoint.durable.write_pieces_atomic``, hashed while written: no joined copy); the
memory tier pads the header to a fixed capacity so every tensor has a fixed offset in a
preallocated buffer. One reader, ``parse_shard``, for both and for any safetensors file: JSON and
raw bytes only, never pickle; the integrity check (sha256 of the bytes) is the caller's, before it
parses.

Formats: ``partitioner-checkpoint/1`` shards were ``safetensors.torch.save``'s bytes and held every
name of the rank; ``/2`` (``FORMAT``) is the layout above, and a shard holds only the names its
rank writes (Note [one writer per byte] in runtime/resilience/checkpoint/writers.py: the manifest lists
them). Both are read (``READABLE_FORMATS``; tests/golden/checkpoint_format_1 is a /1 one).
"""

from __future__ import annotations

import json

import torch

FORMAT = "partitioner-checkpoint/2"
READABLE_FORMATS = ("partitioner-checkpoint/1", FORMAT)

# safetensors dtype names (the ones this torch has)
_ST_DTYPES = {getattr(torch, name): st for name, st in (
    ("float32", "F32"), ("float16", "F16"), ("bfloat16", "BF16"), ("float64", "F64"), ("int64", "I64"),
    ("int32", "I32"), ("int16", "I16"), ("int8", "I8"), ("uint8", "U8"), ("bool", "BOOL"),
    ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("complex64", "C64"), ("uint16", "U16"),
    ("uint32", "U32"), ("uint64", "U64")) if hasattr(torch, name)}
_ST_BY_NAME = {v: k for k, v in _ST_DTYPES.items()}


def step_dirname(step: int) -> str:
    return f"step_{step:09d}"


def shard_filename(rank: int) -> str:
    return f"shard_rank_{rank:05d}.safetensors"


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor, without a copy when it is contiguous."""
    flat = t.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def shard_pieces(snap) -> list:
    """A snapshot's shard as the disk tier writes it (``snap.tensors``, ``snap.meta``): the header,
    then each tensor's bytes in layout order (views of the snapshot's tensors)."""
    items = sorted(snap.tensors.items())
    layout = ShardLayout(items, meta_capacity=len(_meta_text(snap.meta)))
    header = layout.header(snap.meta)
    assert header is not None  # the capacity is the meta's own length
    tensors = dict(items)
    return [header] + [tensor_bytes(tensors[name]) for name in layout.order]


def serialize(snap) -> bytes:
    """The bytes ``shard_pieces`` writes, joined (tests and benchmarks)."""
    return b"".join(bytes(p) for p in shard_pieces(snap))


def _meta_text(meta: dict) -> str:
    return json.dumps({"meta": json.dumps(meta, sort_keys=True)}, separators=(",", ":"))


class ShardLayout:
    """Byte offsets of every tensor in a safetensors file whose header is padded to a fixed
    capacity: the same tensors always land at the same place, so a snapshot is a copy into a
    preallocated buffer (Note [memory snapshot] in runtime/resilience/memtier/tier.py). Tensors are ordered
    by element size, largest first (every offset stays aligned to its element size); the header
    is padded with spaces (valid JSON whitespace)."""

    def __init__(self, tensors: list[tuple[str, torch.Tensor]], meta_capacity: int):
        self.signature = [(n, tuple(t.shape), t.dtype) for n, t in tensors]
        order = sorted(self.signature, key=lambda e: (-_element_size(e[2]), e[0]))
        entries, offset = {}, 0
        self.offsets: dict[str, tuple[int, int]] = {}
        self.order = [name for name, _, _ in order]
        for name, shape, dtype in order:
            nbytes = int(torch.Size(shape).numel()) * _element_size(dtype)
            entries[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self.offsets[name] = (offset, nbytes)
            offset += nbytes
        self.data_bytes = offset
        self._tensor_json = json.dumps(entries, separators=(",", ":"))
        need = len(self._tensor_json) + meta_capacity + 64
        self.header_len = -(-(8 + need) // 64) * 64 - 8  # data starts 64-byte aligned
        self.total_bytes = 8 + self.header_len + self.data_bytes

    def matches(self, tensors: list[tuple[str, torch.Tensor]]) -> bool:
        return len(tensors) == len(self.signature) and all(
            (n, tuple(t.shape), t.dtype) == s for (n, t), s in zip(tensors, self.signature))

    def header(self, meta: dict) -> bytes | None:
        """The 8-byte length and the padded JSON header; None when ``meta`` outgrew the capacity."""
        text = '{"__metadata__":' + _meta_text(meta) + "," + self._tensor_json[1:]
        raw = text.encode()
        if len(raw) > self.header_len:
            return None
        return self.header_len.to_bytes(8, "little") + raw + b" " * (self.header_len - len(raw))

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        start = 8 + self.header_len
        out = {}
        for name, shape, dtype in self.signature:
            off, nbytes = self.offsets[name]
            out[name] = buf[start + off:start + off + nbytes].view(dtype).view(shape)
        return out


def parse_shard(data) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, meta) of a safetensors shard held in a writable buffer, without copying: the
    tensors are views of ``data`` (restore copies them into the trainer). JSON only, never pickle;
    offsets are checked like safetensors does (contiguous, inside the buffer, sizes match).
    Raises ValueError (or KeyError, TypeError) on anything malformed."""
    view = memoryview(data).cast("B")
    header_len = int.from_bytes(view[:8], "little")
    if not 0 < header_len <= len(view) - 8:
        raise ValueError(f"header length {header_len} does not fit {len(view)} bytes")
    header = json.loads(bytes(view[8:8 + header_len]))
    meta = json.loads(header.pop("__metadata__")["meta"])
    start, end = 8 + header_len, 0
    raw = torch.frombuffer(view, dtype=torch.uint8) if len(view) else torch.zeros(0, dtype=torch.uint8)
    tensors = {}
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        lo, hi = info["data_offsets"]
        dtype = _ST_BY_NAME[info["dtype"]]
        shape = [int(x) for x in info["shape"]]
        if lo != end or hi < lo or start + hi > len(view) or (hi - lo) != torch.Size(shape).numel() * _element_size(dtype):
            raise ValueError(f"tensor {name!r} has offsets {lo}..{hi} after {end}")
        end = hi
        piece = raw[start + lo:start + hi]
        if (start + lo) % _element_size(dtype) == 0 and piece.numel():
            tensors[name] = piece.view(dtype).view(shape)
        elif not piece.numel():
            tensors[name] = torch.empty(shape, dtype=dtype)
        else:  # not aligned to its element size: a copy
            tensors[name] = torch.frombuffer(bytearray(piece.numpy().tobytes()), dtype=dtype).view(shape)
    if start + end != len(view):
        raise ValueError(f"the tensors end at byte {start + end}, the buffer has {len(view)}")
    return tensors, meta
