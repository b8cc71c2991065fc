"""Lossless incremental checkpoints (``--checkpoint-compression lossless``).

Note [lossless deltas]: between two checkpoints most bytes of the parameters and the Adam state
change only in their low-order bits. A tensor is stored as the XOR of its bit pattern with the
same tensor in the previous committed checkpoint (the base; none in a full checkpoint), cut into
byte planes (every element's byte 0, then every byte 1, ...: the unchanged high bytes become long
runs of zeros), compressed with zstd. The encoded shard has the same layout as any shard
(runtime/resilience/checkpoint/shard.py): a uint8 tensor "enc/<key>" per encoded tensor, and its meta's
"encoding" says the codec, the base step and, per key, dtype, shape, whether it is a delta and the
sha256 of the original bytes. RNG states are stored as they are.

Reading a delta reads its base first (the same name in the base checkpoint, wherever it is held:
a reshard reads chains like anything else), XORs, and checks the reconstructed bytes against the
sha256: a chain whose base is missing or corrupt is a CheckpointCorruptError, so recovery falls
back as from any corrupt checkpoint. Every ``full_every``-th checkpoint is a full one, so a chain
is never longer than that (at most ``MAX_FULL_EVERY``: every resume reads the whole chain and
retention keeps all of it, Note [retention under deltas]); a writer starts with a full one after a start or a rollback (it keeps
the base in host memory). Retention keeps every base a kept checkpoint needs
(runtime/resilience/checkpoint/manifest.py, ``prune``).
"""

from __future__ import annotations

import hashlib

import torch

from runtime.resilience.checkpoint.shard import _ST_BY_NAME, _ST_DTYPES, tensor_bytes
from runtime.resilience.checkpoint.state import Snapshot
from runtime.errors import CheckpointCorruptError, MissingPackageError

CODEC = "xor-byteplanes-zstd/1"
COMPRESSIONS = ("none", "lossless")
FULL_EVERY = 8  # a full checkpoint every 8 (a chain reads at most 7 bases)
# the most --checkpoint-full-every may say: a resume reads at most 63 bases, retention keeps at
# most --keep-checkpoints + 63 folders (runtime/launch/run_options.py repeats it: no torch there)
MAX_FULL_EVERY = 64
LEVEL = 1  # zstd's fastest standard level: the planes of a delta are mostly zeros anyway


def _zstd(reading: str | None = None):
    """The zstandard module; MissingPackageError, one line naming the fix, when it is not installed
    (Note [what the runtime needs]). ``reading``: the lossless shard being read, when it is a read
    (the flag is not the cause then, and the shard is not corrupt: it must not be skipped as one)."""
    try:
        # optional dependency: zstandard (the [compression] extra); the except below handles its absence
        import zstandard
    except ImportError:
        if reading is not None:
            raise MissingPackageError(f"{reading} is a lossless checkpoint (--checkpoint-compression lossless): "
                                      "reading it needs the zstandard package, which is not installed here: "
                                      "pip install zstandard") from None
        raise MissingPackageError("--checkpoint-compression lossless needs the zstandard package, which is not "
                                  "installed here: pip install zstandard (or pass --checkpoint-compression "
                                  "none)") from None
    return zstandard


def _planes(raw: torch.Tensor, size: int) -> torch.Tensor:
    """Byte k of every element, for k = 0..size-1 (numpy's strided slices: ~4x torch's transpose)."""
    if size == 1:
        return raw
    x, n = raw.numpy(), raw.numel() // size
    out = torch.empty(raw.numel(), dtype=torch.uint8)
    o = out.numpy()
    for k in range(size):
        o[k * n:(k + 1) * n] = x[k::size]
    return out


def _unplanes(planes: torch.Tensor, size: int) -> torch.Tensor:
    if size == 1:
        return planes
    x, n = planes.numpy(), planes.numel() // size
    out = torch.empty(planes.numel(), dtype=torch.uint8)
    o = out.numpy()
    for k in range(size):
        o[k::size] = x[k * n:(k + 1) * n]
    return out


def encode_tensor(t: torch.Tensor, base: torch.Tensor | None) -> bytes:
    """zstd(byte planes(t XOR base)); ``base`` of the same shape and dtype, or None."""
    raw = torch.frombuffer(tensor_bytes(t), dtype=torch.uint8) if t.numel() else torch.zeros(0, dtype=torch.uint8)
    if base is not None:
        raw = torch.bitwise_xor(raw, torch.frombuffer(tensor_bytes(base), dtype=torch.uint8))
    planes = _planes(raw, t.element_size())
    return _zstd().ZstdCompressor(level=LEVEL).compress(memoryview(planes.numpy()))


def decode_tensor(blob, dtype: torch.dtype, shape, base: torch.Tensor | None) -> torch.Tensor:
    size = torch.empty((), dtype=dtype).element_size()
    nbytes = int(torch.Size(shape).numel()) * size
    if isinstance(blob, torch.Tensor):  # a uint8 view of the shard's bytes
        blob = tensor_bytes(blob)
    zstd = _zstd()
    # Note [bounded decompression]: zstd sizes its output by the frame's own header, not by
    # max_output_size (which bounds only a frame that declares no size), so a 138 KiB frame that
    # declares gigabytes allocates them: the declared size is checked against the tensor's first.
    # The tensor's size is the shard's own word too (its meta's shape), so what bounds it is the
    # plan, before any frame of the shard is decompressed (``decode_shard``'s ``bound``, the sum
    # of ``decoded_bytes``): a 72 KiB frame whose meta and header agreed on 3.3 GiB was
    # decompressed at every resume and listed valid by inspect. The bound is the plan's most bytes
    # of one shard (Note [declared sizes are bounded] in runtime/program/spec.py: what one rank's
    # stages hold, twice, plus 64 MiB), which decoded tensors are within as stored ones are; so
    # no more is allocated (three times over while the planes are put back). A plan without stage
    # memory (hand-written) bounds nothing at resume; ``inspect`` of a checkpoint folder with no
    # plan beside it, or with such a plan, decompresses at most UNPLANNED_DECODE_BYTES of a shard
    # and lists one that declares more as "unchecked", neither valid nor corrupt (it may be a big
    # model's).
    declared = zstd.frame_content_size(blob) if len(blob) else 0
    if declared not in (-1, nbytes) and len(blob):
        raise ValueError(f"its zstd frame declares {declared} bytes, the tensor is {nbytes}")
    data = zstd.ZstdDecompressor().decompress(blob, max_output_size=nbytes)
    if len(data) != nbytes:
        raise ValueError(f"decompressed {len(data)} bytes, want {nbytes}")
    raw = _unplanes(torch.frombuffer(bytearray(data), dtype=torch.uint8), size) if nbytes else \
        torch.zeros(0, dtype=torch.uint8)
    if base is not None:
        raw = torch.bitwise_xor(raw, torch.frombuffer(tensor_bytes(base), dtype=torch.uint8))
    return raw.view(dtype).view(shape) if nbytes else torch.empty(shape, dtype=dtype)


class DecodeBoundError(CheckpointCorruptError):
    """A shard whose encoding declares more decoded bytes than its bound (Note [bounded
    decompression]); nothing of it was decompressed."""

    def __init__(self, where: str, declared: int, bound: int):
        super().__init__(f"{where}: its tensors declare {declared} bytes decoded, more than the {bound} a shard of "
                         "this plan can hold: not decompressed")
        self.where, self.declared, self.bound = where, declared, bound


UNPLANNED_DECODE_BYTES = 1 << 30  # what inspect decompresses of one shard when no plan bounds it


def decoded_bytes(meta: dict, where: str) -> int:
    """The bytes an encoded shard's tensors declare they decode to (its meta's dtypes and shapes,
    checked by check_meta), summed; CheckpointCorruptError for a dtype no shard has."""
    enc = meta.get("encoding") if isinstance(meta, dict) else None
    total = 0
    for key, e in (enc.get("tensors") or {}).items() if isinstance(enc, dict) else ():
        dtype = _ST_BY_NAME.get(e.get("dtype")) if isinstance(e, dict) else None
        if dtype is None:
            raise CheckpointCorruptError(f"{where}: the encoding of {key!r} names no known dtype "
                                         f"({e.get('dtype') if isinstance(e, dict) else e!r})")
        total += int(torch.Size(e["shape"]).numel()) * torch.empty((), dtype=dtype).element_size()
    return total


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(tensor_bytes(t)).hexdigest()


def encode_snapshot(snap, base: dict[str, torch.Tensor] | None, base_step: int | None):
    """The Snapshot ``snap`` with every tensor but the RNG states encoded (Note [lossless
    deltas]); a delta against ``base`` (the previous committed checkpoint's tensors, by key) where
    it holds the same key with the same shape and dtype."""
    tensors: dict[str, torch.Tensor] = {}
    entries: dict[str, dict] = {}
    for key, t in snap.tensors.items():
        if key.startswith("rng/"):
            tensors[key] = t
            continue
        b = base.get(key) if base is not None else None
        delta = b is not None and b.shape == t.shape and b.dtype == t.dtype
        blob = encode_tensor(t, b if delta else None)
        tensors["enc/" + key] = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else \
            torch.zeros(0, dtype=torch.uint8)
        entries[key] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "delta": delta, "sha256": _sha(t)}
    # the base step even for a shard without deltas: retention reads the chain from the manifest,
    # which records rank 0's
    meta = {**snap.meta, "encoding": {"codec": CODEC, "base_step": base_step if base is not None else None,
                                      "tensors": entries}}
    return Snapshot(snap.step, snap.rank, tensors, meta, snap.stall_s)


def decode_shard(tensors: dict[str, torch.Tensor], meta: dict, base_tensor, where: str,
                 bound: int | None = None) -> dict[str, torch.Tensor]:
    """The original tensors of an encoded shard; ``base_tensor(key)`` fetches a delta's base
    (reading the base checkpoint). Every reconstruction is checked against its sha256. ``bound``:
    the most bytes its tensors may decode to, checked before any is decompressed (Note [bounded
    decompression]); None: unbounded."""
    enc = meta.get("encoding")
    if not enc:
        return tensors
    if enc.get("codec") != CODEC:
        raise CheckpointCorruptError(f"{where} is encoded with {enc.get('codec')!r}, not {CODEC!r}")
    declared = decoded_bytes(meta, where)
    if bound is not None and declared > bound:
        raise DecodeBoundError(where, declared, bound)
    _zstd(reading=where)  # before the loop's except: a missing package is not a corrupt shard
    out = {k: v for k, v in tensors.items() if k.startswith("rng/")}
    for key, e in enc["tensors"].items():
        blob = tensors.get("enc/" + key)
        if blob is None:
            raise CheckpointCorruptError(f"{where} lacks the encoded tensor {key!r}")
        dtype, shape = _ST_BY_NAME[e["dtype"]], [int(x) for x in e["shape"]]
        base = base_tensor(key) if e["delta"] else None
        if base is not None and (list(base.shape) != shape or base.dtype != dtype):
            raise CheckpointCorruptError(f"{where}: the base of {key!r} is {tuple(base.shape)} {base.dtype}")
        try:
            t = decode_tensor(blob, dtype, shape, base)
        except Exception as exc:  # noqa: BLE001 - any decode failure is corruption
            raise CheckpointCorruptError(f"{where}: {key!r} does not decode ({exc})") from None
        if _sha(t) != e["sha256"]:
            raise CheckpointCorruptError(f"{where}: {key!r} reconstructed from its base fails its sha256")
        out[key] = t
    return out
