"""A Hugging Face model's weights, made by the rank that holds them: its own initialisation, or
pretrained safetensors read tensor by tensor.

Note [own initialisation per rank]: a Hugging Face model initialises itself (``_init_weights``:
GPT-2's residual projections scaled by 1/sqrt(2 * layers), ViT's truncated normals, rotary
tables), drawing from torch's global generator in module order, so the values depend on every
draw made before. To make them depend on (seed, module, tensor) only, ``own_init`` runs the
model's own ``initialize_weights`` over the whole model built on the meta device, and gives the
random calls that initialise tensor T while module M is initialised a generator of their own,
seeded by (seed, M's name, T's name) (``_KeyedDraws``). A draw into a meta tensor changes
nothing and consumes no other tensor's generator, so a rank materialises only its stage's
tensors (``materialize``; a tied group as one), runs the same traversal, and gets exactly the
values a process holding the whole model gets: the same on any partition, in the one-process
oracle (partitioner/models/hf.py builds its model this way), and after a reshard. A tensor no initialisation writes is an error, not garbage: materialised tensors start
as NaN (integers: their minimum) and are checked afterwards.

Note [pretrained per rank]: ``--pretrained DIR`` names Hugging Face safetensors (model.safetensors,
or shards listed by model.safetensors.index.json). Each rank opens the files that hold its
stage's tensors and reads only those (``safe_open`` reads one tensor at a time), by original
name; a name missing from the files is looked up without or with the base model's prefix
(GPT-2's checkpoints say ``h.0.attn...`` for ``transformer.h.0.attn...``) and through the
model's tied aliases (``lm_head.weight`` is ``transformer.wte.weight``). Buffers the files do not
hold (non-persistent rotary tables) and parameters they lack (a new classification head) come
from the model's own initialisation, the latter named in a warning, as ``from_pretrained`` does.
``OPENED`` records what this process read, per file.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import zlib

import torch
from torch.overrides import TorchFunctionMode

from runtime.errors import MissingPackageError, import_failure
from runtime.file_trust import JSON_CAP, open_regular, read_bounded

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
OPENED: dict[str, list[str]] = {}  # file -> tensor names this process read from it, in order

# Every random call an initialisation may make; each takes generator= (torch 2.13).
_RANDOM = {torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.bernoulli_, torch.Tensor.random_,
           torch.Tensor.exponential_, torch.Tensor.geometric_, torch.Tensor.log_normal_, torch.Tensor.cauchy_,
           torch.normal, torch.rand, torch.randn, torch.randint, torch.randperm, torch.bernoulli,
           torch.multinomial}
# torch.nn.init's functions reach a torch function mode as themselves (they dispatch on their
# tensor argument), or as transformers' guarded copies of them while a model initialises
# (transformers.initialization patches torch.nn.init); what they call inside runs with the mode
# off, so one generator serves one call.
_INIT_FUNCTIONS = {"normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
                   "xavier_uniform_", "xavier_normal_", "orthogonal_", "sparse_"}
_INIT_MODULES = {"torch.nn.init", "transformers.initialization"}


def _is_random(func) -> bool:
    return func in _RANDOM or (getattr(func, "__name__", None) in _INIT_FUNCTIONS
                               and getattr(func, "__module__", None) in _INIT_MODULES)


def draw_seed(seed: int, module: str, tensor: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(f"{module}#{tensor}".encode())) % (2**63)


class _KeyedDraws(TorchFunctionMode):
    """Gives the random calls that initialise tensor T while module M is initialised a generator of
    their own, seeded by (seed, M, T) (Note [own initialisation per rank]). Keyed by tensor, not by
    call: an initialiser may return early for a meta tensor or redraw until values fit
    (trunc_normal_), so how many calls a module makes differs between ranks; a temporary an
    initialiser draws into shares the generator of the tensor it is for."""

    def __init__(self, seed: int, names: dict[int, str], storages: dict[int, str]):
        super().__init__()
        self.seed, self.names, self.storages = seed, names, storages
        self.module, self.target, self.generators = "", "", {}

    def visit(self, module: str) -> None:
        self.module, self.target = module, ""

    def _name(self, t) -> str | None:
        if not isinstance(t, torch.Tensor):
            return None
        name = self.names.get(id(t))
        if name is None and t.device.type == "cpu" and t.numel():  # a view (.data, a slice) of a tensor
            name = self.storages.get(t.untyped_storage().data_ptr())
        return name

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_random(func):
            name = self._name(kwargs.get("tensor", args[0] if args else None))
            if name is not None:
                self.target = name
            key = (self.module, self.target)
            if key not in self.generators:
                self.generators[key] = torch.Generator().manual_seed(draw_seed(self.seed, *key))
            kwargs["generator"] = self.generators[key]
        return func(*args, **kwargs)


def config_dict(config) -> dict:
    """A transformers config as the plain JSON dict plan.json holds (``build_meta`` reads it back)."""
    return json.loads(config.to_json_string(use_diff=False))


def require_transformers():
    try:
        # optional dependency: transformers (the [hf] extra); the except below handles its absence
        import transformers
    except ImportError as exc:
        if exc.name != "transformers":  # installed, but something it imports is broken
            raise MissingPackageError(f"transformers does not import: {import_failure(exc)}") from None
        raise ValueError("Hugging Face models need transformers on every node: pip install "
                         "'partitioner[hf]' (transformers==5.24.0, the version the tests pin)") from None
    return transformers


def build_meta(config: dict, architecture: str) -> torch.nn.Module:
    """The model class ``architecture`` (a transformers class name) from a config dict, on meta."""
    transformers = require_transformers()

    try:
        cls = getattr(transformers, architecture, None)
    except ImportError as exc:  # Note [the real import error] in runtime/errors.py; a rank prints it as one line
        raise MissingPackageError(f"transformers cannot import {architecture}: {import_failure(exc)}") from None
    if cls is None:
        raise ValueError(f"transformers {transformers.__version__} has no model class {architecture!r}: "
                         "install the transformers version the program was compiled with")
    cfg = transformers.CONFIG_MAPPING[config["model_type"]].from_dict(dict(config))
    with torch.device("meta"):
        model = cls(cfg)
    return model


def owner_of(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    prefix, _, leaf = name.rpartition(".")
    return (model.get_submodule(prefix) if prefix else model), leaf


def aliases(model: torch.nn.Module) -> dict[str, list[str]]:
    """Every parameter and buffer name -> all names of the same tensor (tied weights), first first."""
    by_id: dict[int, list[str]] = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
        by_id.setdefault(id(t), []).append(name)
    return {n: names for names in by_id.values() for n in names}


def _sentinel(t: torch.Tensor) -> torch.Tensor:
    value = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return value.fill_(float("nan"))
    if t.dtype == torch.bool:
        return value.fill_(False)
    return value.fill_(torch.iinfo(t.dtype).min)


def _unset(t: torch.Tensor) -> bool:
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return bool(torch.isnan(t).any())
    if t.dtype == torch.bool:
        return False
    return bool((t == torch.iinfo(t.dtype).min).any())


def materialize(model: torch.nn.Module, names) -> None:
    """Give ``names`` (and their tied aliases) real CPU storage, filled with a sentinel; the rest
    stays on meta."""
    alias = aliases(model)
    done: set[str] = set()
    for name in names:
        if name in done:
            continue
        if name not in alias:
            raise ValueError(f"the model has no parameter or buffer {name!r}: recompile the program")
        owner, leaf = owner_of(model, name)
        old = getattr(owner, leaf)
        new = _sentinel(old)
        if isinstance(old, torch.nn.Parameter):  # one Parameter for all its tied names
            new = torch.nn.Parameter(new, requires_grad=old.requires_grad)
        for each in alias[name]:
            o, l = owner_of(model, each)
            (o._parameters if isinstance(old, torch.nn.Parameter) else o._buffers)[l] = new
            done.add(each)


def own_init(model: torch.nn.Module, seed: int) -> None:
    """The model's own initialisation, keyed by module (Note [own initialisation per rank])."""
    # lazy: loads transformers (the [hf] extra)
    from transformers import PreTrainedModel

    names: dict[int, str] = {}
    storages: dict[int, str] = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
        names.setdefault(id(t), name)
        if t.device.type == "cpu" and t.numel():
            storages.setdefault(t.untyped_storage().data_ptr(), name)
    mode = _KeyedDraws(seed, names, storages)
    module_names: dict[int, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        module_names.setdefault(id(module), name)
    wrapped = []
    for sub in model.modules():
        if isinstance(sub, PreTrainedModel):
            original = sub._init_weights

            def keyed(module, original=original):
                mode.visit(module_names.get(id(module), ""))
                return original(module)

            sub._init_weights = keyed  # an instance attribute shadows the method
            wrapped.append(sub)
    try:
        with mode:
            model.initialize_weights()
    finally:
        for sub in wrapped:
            del sub._init_weights
        for module in model.modules():  # a second call must initialise again
            module.__dict__.pop("_is_hf_initialized", None)


def initial_weights(model: torch.nn.Module, names, seed: int) -> dict[str, torch.Tensor]:
    """``names`` of a meta-built model, materialised and initialised by the model's own init."""
    names = list(dict.fromkeys(names))
    materialize(model, names)
    own_init(model, seed)
    out = {}
    for name in names:
        owner, leaf = owner_of(model, name)
        value = getattr(owner, leaf).detach()
        if _unset(value):
            raise ValueError(f"{type(model).__name__}'s own initialisation (_init_weights) does not set {name!r}, "
                             "so the ranks cannot make it: build the model on cpu (hf:...,device=cpu), or "
                             "give --pretrained weights that hold it")
        out[name] = value.clone()
    return out


# -- pretrained safetensors --------------------------------------------------------------------


# Note [weights files are checked first]: safetensors' own errors name no file ("header too large"),
# and an index is whatever JSON the folder holds. So before safe_open sees a file it must be a
# regular one (no FIFO: Note [files are not trusted]) whose 8-byte header length fits in the file
# and under HEADER_CAP (safetensors' own limit), its header a JSON object; an index must map names
# to bare file names of the folder (no path out of it); anything safe_open still raises becomes a
# ValueError naming the file and the fix. A compile refuses such a folder in one line, before any
# rank starts.
HEADER_CAP = 100 << 20  # bytes: the largest header safetensors itself reads


def _not_weights(folder: str, file: str, why: str) -> ValueError:
    return ValueError(f"--pretrained {folder}: {os.path.basename(file)} is not a safetensors file ({why}): "
                      "re-save the weights with model.save_pretrained(DIR)")


def _check_header(folder: str, file: str) -> None:
    try:
        fd = open_regular(file, follow=True)
    except FileNotFoundError:
        listed = f" ({INDEX} lists it)" if os.path.lexists(os.path.join(folder, INDEX)) else ""
        raise ValueError(f"--pretrained {folder}: {os.path.basename(file)} is missing{listed}: copy the whole "
                         "folder save_pretrained wrote") from None
    except OSError as exc:
        raise ValueError(f"--pretrained {folder}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        head = fh.read(9)
    if len(head) < 9:
        raise _not_weights(folder, file, f"{size} bytes: too short to hold a header")
    n = int.from_bytes(head[:8], "little")
    if n > HEADER_CAP:
        raise _not_weights(folder, file, f"its header claims {n} bytes, more than the {HEADER_CAP >> 20} MiB "
                           "safetensors allows")
    if n > size - 8:
        raise _not_weights(folder, file, f"its header claims {n} bytes, the file has {size}")
    if head[8:9] != b"{":
        raise _not_weights(folder, file, "its header is no JSON object")


@contextlib.contextmanager
def open_weights(folder: str, file: str):
    """safe_open(file) after ``_check_header``; safetensors' errors named (Note [weights files are
    checked first])."""
    # lazy: loads safetensors
    from safetensors import SafetensorError, safe_open

    _check_header(folder, file)
    try:
        with safe_open(file, framework="pt") as fh:
            yield fh
    except SafetensorError as exc:
        raise _not_weights(folder, file, str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None


def _bare(name) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and os.path.basename(name) == name \
        and "\\" not in name and "\0" not in name


def weight_files(folder: str) -> dict[str, str]:
    """Tensor name -> file in ``folder`` (model.safetensors or the shards its index lists)."""
    index = os.path.join(folder, INDEX)
    if os.path.lexists(index):
        try:
            body = json.loads(read_bounded(index, cap=JSON_CAP, follow=True))
        except (OSError, ValueError) as exc:
            raise ValueError(f"{index} is not a safetensors index ({exc}): re-save the model with "
                             "save_pretrained") from None
        weight_map = body.get("weight_map") if isinstance(body, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(k, str) and _bare(v) for k, v in weight_map.items()):
            shown = repr(weight_map if isinstance(body, dict) else body)
            raise ValueError(f"{index} is not a safetensors index: its weight_map must map tensor names to file "
                             f"names in {folder}, it is {shown[:60]}{'...' * (len(shown) > 60)}; re-save the model "
                             "with save_pretrained")
        return {name: os.path.join(folder, file) for name, file in weight_map.items()}
    single = os.path.join(folder, SINGLE)
    if os.path.lexists(single):
        with open_weights(folder, single) as fh:
            return {name: single for name in fh.keys()}
    found = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    raise ValueError(f"--pretrained {folder}: no {SINGLE} or {INDEX} there (found {found[:6]}); save the "
                     "weights as safetensors: model.save_pretrained(DIR) (PyTorch .bin files are not read: "
                     "they unpickle)")


def _candidates(name: str, prefix: str) -> list[str]:
    out = [name]
    if prefix and name.startswith(prefix + "."):
        out.append(name[len(prefix) + 1:])
    elif prefix:
        out.append(f"{prefix}.{name}")
    return out


def locate(model: torch.nn.Module, names, folder: str) -> dict[str, tuple[str, str]]:
    """Our name -> (file, its name in the file) for the ``names`` the folder holds, through the
    base model's prefix and tied aliases (Note [pretrained per rank])."""
    files = weight_files(folder)
    alias = aliases(model)
    prefix = getattr(model, "base_model_prefix", "") or ""
    found: dict[str, tuple[str, str]] = {}
    for name in names:
        for candidate in (c for each in alias.get(name, [name]) for c in _candidates(each, prefix)):
            if candidate in files:
                found[name] = (files[candidate], candidate)
                break
    return found


# Note [a stored dtype of the right kind]: a tensor is converted to the model's dtype (an F16 file
# into an F32 model is fine), but a float tensor whose header says I32 converts its bit patterns
# into integers of a billion, silently: the header's dtype must be of the parameter's kind
# (floating, integer, bool), else the tensor is refused by name.
def _kind(dtype) -> str:
    """"floating", "integer" or "bool", of a torch dtype or a safetensors dtype name ("F32", "I64")."""
    if isinstance(dtype, str):
        return "bool" if dtype == "BOOL" else "integer" if dtype[:1] in ("I", "U") else "floating"
    if dtype == torch.bool:
        return "bool"
    return "floating" if dtype.is_floating_point or dtype.is_complex else "integer"


def _check_kind(folder: str, file: str, stored: str, stored_dtype, name: str, want_dtype) -> None:
    if _kind(stored_dtype) != _kind(want_dtype):
        raise ValueError(f"--pretrained {folder}: {stored} is {stored_dtype} in {os.path.basename(file)}, but the "
                         f"model's {name} is {want_dtype} ({_kind(want_dtype)}): the file's dtype is wrong; "
                         "re-save the weights with save_pretrained")


def check_shapes(model: torch.nn.Module, folder: str) -> int:
    """Every tensor of a meta-built ``model`` that ``folder`` holds has the model's shape (read
    from the files' headers only); returns how many it holds. The compiler calls this, so that a
    mismatch is one error at compile time, not one per rank."""
    found = locate(model, list(aliases(model)), folder)
    by_file: dict[str, list[str]] = {}
    for name, (file, _) in found.items():
        by_file.setdefault(file, []).append(name)
    for file, ours in by_file.items():
        with open_weights(folder, file) as fh:
            for name in ours:
                piece = fh.get_slice(found[name][1])
                shape = tuple(piece.get_shape())
                param = getattr(*owner_of(model, name))
                want = tuple(param.shape)
                _check_kind(folder, file, found[name][1], piece.get_dtype(), name, param.dtype)
                if shape != want:
                    raise ValueError(f"--pretrained {folder}: {found[name][1]} is {shape} in {os.path.basename(file)}, "
                                     f"the model's {name} is {want}: the weights are of another configuration; "
                                     "compile with their config.json")
    return len(found)


def pretrained_weights(model: torch.nn.Module, names, folder: str, seed: int, *,
                       say=None) -> dict[str, torch.Tensor]:
    """``names`` read from ``folder``'s safetensors (Note [pretrained per rank]); what the files lack
    is made by the model's own initialisation."""
    plan = locate(model, names, folder)
    missing = [n for n in names if n not in plan]
    out = initial_weights(model, missing, seed) if missing else {}
    params = dict(model.named_parameters(remove_duplicate=False))
    lacking = [n for n in missing if n in params]
    if lacking and say:
        say(f"pretrained: {folder} has no tensor for {len(lacking)} parameter(s) {lacking[:4]}: "
            "they start from the model's own initialisation")
    by_file: dict[str, list[str]] = {}
    for name, (file, _) in plan.items():
        by_file.setdefault(file, []).append(name)
    for file, ours in by_file.items():
        with open_weights(folder, file) as fh:
            for name in ours:
                stored = plan[name][1]
                owner, leaf = owner_of(model, name)
                want = getattr(owner, leaf)
                _check_kind(folder, file, stored, fh.get_slice(stored).get_dtype(), name, want.dtype)  # before reading
                tensor = fh.get_tensor(stored)
                OPENED.setdefault(file, []).append(stored)
                if tuple(tensor.shape) != tuple(want.shape):
                    raise ValueError(f"--pretrained {folder}: {stored} is {tuple(tensor.shape)} in "
                                     f"{os.path.basename(file)}, the model's {name} is {tuple(want.shape)}: "
                                     "the weights are of another configuration; compile with their config.json")
                out[name] = tensor.to(want.dtype)
    return out


def hf_weights(names, *, config: dict, architecture: str, seed: int, pretrained: str | None = None,
               report: bool = True):
    """What a rank calls for its stage's tensors (plan.json program.init.weights): pretrained
    safetensors when the program names them, else the model's own initialisation. ``report``:
    print how many tensors of the files this call read."""
    model = build_meta(config, architecture)
    names = list(names)
    if pretrained is None or not names:
        return initial_weights(model, names, seed)
    if not report:
        return pretrained_weights(model, names, pretrained, seed)
    before = sum(len(v) for v in OPENED.values())
    out = pretrained_weights(model, names, pretrained, seed, say=lambda m: print(m, file=sys.stderr, flush=True))
    read = sum(len(v) for v in OPENED.values()) - before
    total = len(weight_files(pretrained))
    print(f"[rank {os.environ.get('RANK', 0)}] pretrained: read {read} of the {total} tensors in {pretrained}",
          flush=True)
    return out
