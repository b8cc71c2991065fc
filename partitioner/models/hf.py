"""``hf:<name-or-dir>``: a Workload from a Hugging Face config, local files only.

    hf:path/to/dir                       config.json there (a name: the local Hugging Face cache)
    hf:path/to/dir,task=masked-lm,seq=64,batch=4,seed=1,device=meta,attn=eager
    hf:path/to/resnet,image=64           an image model's input side (default: the config's, else 224)

The task (causal-lm, masked-lm, image-classification, seq2seq) comes from the config's
``architectures`` unless given. The model is built on the meta device, then materialised on the
CPU with its own initialisation keyed by module (Note [own initialisation per rank] in
runtime/execute/pretrained.py) unless its training state is over models.META_THRESHOLD_BYTES (or
``device=meta``); either way the program's ranks make their own weights the same way, so the
oracle and every partition start from the same values. With ``pretrained=DIR`` (the CLI's
``--pretrained DIR``) the ranks read their stage's tensors from DIR's safetensors instead (Note
[pretrained per rank]); a CPU-built model for the oracle is loaded by ``from_pretrained``.
Nothing is downloaded: a name not in the local cache is an error that says how to get it.
"""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path

import torch

from partitioner.frontend.workload import Workload
from runtime.data import synthetic as data, hf_tasks as hf_data
from runtime.execute import pretrained as weights
from runtime.errors import import_failure
from runtime.execute.pretrained import require_transformers

# Build on the meta device above this many bytes of training state, as the built-ins do
# (partitioner/models/builtin.py imports this module, so the figure is repeated; a test keeps them equal).
META_THRESHOLD_BYTES = 4 * 2**30
TASKS = ("causal-lm", "masked-lm", "image-classification", "seq2seq")
_MAPPINGS = {"causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
             "image-classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
             "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"}
_OPTIONS = {"task": str, "seq": int, "batch": int, "seed": int, "device": str, "attn": str, "pretrained": str,
            "image": int}
# An image model's input side when the config names none (ResNet's config.json has no image_size):
# 224, the crop its Hugging Face image processors make; ``image=`` sets another.
DEFAULT_IMAGE_SIZE = 224


def parse_spec(spec: str) -> tuple[str, dict]:
    """``hf:NAME[,key=value...]`` -> (NAME, options), with errors naming the spec and the fix."""
    body = spec.removeprefix("hf:")
    name, *items = body.split(",")
    if not name:
        raise ValueError(f"MODEL {spec!r}: give a config folder or a model name after hf: (e.g. hf:./tiny-gpt2)")
    options = {}
    for item in items:
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in _OPTIONS:
            raise ValueError(f"MODEL {spec!r}: {item!r} is not one of {', '.join(k + '=' for k in _OPTIONS)} "
                             "(e.g. hf:./tiny-gpt2,seq=32,batch=2)")
        try:
            options[key] = _OPTIONS[key](value.strip())
        except ValueError:
            raise ValueError(f"MODEL {spec!r}: {key}={value} is not a whole number (e.g. {key}=32)") from None
    return name, options


def load_config(name: str, *, attn: str = "sdpa"):
    """AutoConfig from a folder or the local cache only (HF_HUB_OFFLINE semantics)."""
    transformers = require_transformers()

    try:
        # Note [no remote code]: a folder's own Python (auto_map's configuration_*.py, modeling_*.py)
        # never runs: trust_remote_code is always False, so transformers neither runs it nor asks on
        # stdin (where a piped "y" would say yes), and a model that needs it is refused.
        return transformers.AutoConfig.from_pretrained(name, local_files_only=True, attn_implementation=attn,
                                                       trust_remote_code=False)
    except (OSError, ValueError) as exc:
        if "trust_remote_code" in str(exc) or "custom code" in str(exc):
            raise ValueError(f"MODEL 'hf:{name}': its config needs code of its own (auto_map in config.json), "
                             "and the partitioner never runs a model folder's code: use a model transformers "
                             "ships (a config.json without auto_map)") from None
        if os.path.isdir(name):
            raise ValueError(f"MODEL 'hf:{name}': {name} is a folder but holds no readable config.json ({exc}); "
                             "write one with config.save_pretrained(DIR)") from None
        raise ValueError(
            f"MODEL 'hf:{name}': no local copy of {name!r} (nothing is downloaded at run time; looked for a folder "
            f"{name} and in the Hugging Face cache {os.environ.get('HF_HOME', '~/.cache/huggingface')}): "
            f"download it once where the network is reachable (huggingface-cli download {name} config.json "
            "model.safetensors --local-dir DIR) and pass hf:DIR") from None


def task_of(config, spec: str) -> str:
    for arch in getattr(config, "architectures", None) or ():
        for task, suffixes in (("causal-lm", ("ForCausalLM", "LMHeadModel")), ("masked-lm", ("ForMaskedLM",)),
                               ("image-classification", ("ForImageClassification",)),
                               ("seq2seq", ("ForConditionalGeneration", "ForSeq2SeqLM"))):
            if arch.endswith(suffixes):
                return task
    for task in TASKS:
        if config.model_type in _mapping(task):
            return task
    raise ValueError(f"MODEL {spec!r}: cannot tell the task of model_type {config.model_type!r}: "
                     f"add task=one of {', '.join(TASKS)}")


def _mapping(task: str) -> dict:
    # lazy: loads transformers (the [hf] extra)
    from transformers.models.auto import modeling_auto

    return getattr(modeling_auto, _MAPPINGS[task])


def architecture_of(config, task: str, spec: str) -> str:
    # lazy: loads transformers (the [hf] extra)
    import transformers

    name = _mapping(task).get(config.model_type)
    try:
        known = name is not None and hasattr(transformers, name)
    except ImportError as exc:  # Note [the real import error] in runtime/errors.py
        raise ValueError(f"MODEL {spec!r}: transformers cannot import {name}: {import_failure(exc)}") from None
    if not known:
        raise ValueError(f"MODEL {spec!r}: transformers has no {task} model for model_type {config.model_type!r}; "
                         f"pick task= among those it has, or another model")
    return name


def _state_bytes(model: torch.nn.Module) -> int:
    # weights, gradients and two AdamW moments, as models.gpt sizes its choice of device
    return 4 * sum(p.numel() * p.element_size() for p in model.parameters())


def _data(task: str, config, *, seq: int, batch: int, seed: int, spec: str, image: int | None = None):
    """(example_args, make_batch, loss_fn, source entries) of ``task``."""
    def entry(fn, **kwargs):
        return functools.partial(fn, **kwargs), (f"{fn.__module__}:{fn.__name__}", kwargs)

    vocab = getattr(config, "vocab_size", None)
    if task == "causal-lm":
        make, src = entry(data.token_batch, vocab=vocab, seq=seq, seed=seed)
        return (torch.zeros(batch, seq, dtype=torch.long),), make, data.causal_lm_loss, src, \
            ("runtime.data.synthetic:causal_lm_loss", {})
    if task == "masked-lm":
        mask_id = getattr(config, "mask_token_id", None)
        mask_id = vocab - 1 if mask_id is None else int(mask_id)
        make, src = entry(hf_data.masked_token_batch, vocab=vocab, seq=seq, mask_token_id=mask_id, seed=seed)
        return (torch.zeros(batch, seq, dtype=torch.long),), make, hf_data.masked_lm_loss, src, \
            ("runtime.data.hf_tasks:masked_lm_loss", {})
    if task == "image-classification":
        size = image or getattr(config, "image_size", None) or DEFAULT_IMAGE_SIZE
        size, channels = int(size), int(getattr(config, "num_channels", 3))
        make, src = entry(hf_data.image_batch, channels=channels, size=size, num_labels=int(config.num_labels),
                          seed=seed)
        return (torch.zeros(batch, channels, size, size),), make, hf_data.classification_loss, src, \
            ("runtime.data.hf_tasks:classification_loss", {})
    start = getattr(config, "decoder_start_token_id", None)
    start = 0 if start is None else int(start)
    make, src = entry(hf_data.seq2seq_batch, vocab=vocab, seq=seq, start_token_id=start, seed=seed)
    zeros = torch.zeros(batch, seq, dtype=torch.long)
    return (zeros, torch.ones_like(zeros), zeros), make, hf_data.masked_lm_loss, src, \
        ("runtime.data.hf_tasks:masked_lm_loss", {})


def _max_positions(config) -> int | None:
    for key in ("n_positions", "max_position_embeddings"):
        if isinstance(getattr(config, key, None), int):
            return getattr(config, key)
    return None


def hf_workload(name: str, *, task: str | None = None, seq: int | None = None, batch: int = 2, seed: int = 0,
                device: str | None = None, attn: str = "sdpa", pretrained: str | None = None,
                spec: str | None = None, image: int | None = None) -> Workload:
    """The Workload of a Hugging Face model from its config (this module's docstring)."""
    spec = spec or f"hf:{name}"
    if task is not None and task not in TASKS:
        raise ValueError(f"MODEL {spec!r}: task={task} is not one of {', '.join(TASKS)}")
    if device not in (None, "cpu", "meta"):
        raise ValueError(f"MODEL {spec!r}: device={device}: give cpu or meta (the program picks the accelerator)")
    if batch < 1 or (seq is not None and seq < 1) or (image is not None and image < 1):
        raise ValueError(f"MODEL {spec!r}: batch, seq and image must be at least 1 (e.g. batch=2,seq=32)")
    if pretrained is not None:
        pretrained = str(Path(pretrained).resolve())
        weights.weight_files(pretrained)  # the error about a folder without safetensors, now
    config = load_config(name, attn=attn)
    use_cache = getattr(config, "use_cache", None)
    if hasattr(config, "use_cache"):
        config.use_cache = False  # a traced training step keeps no key/value cache
    task = task or task_of(config, spec)
    architecture = architecture_of(config, task, spec)
    if task != "image-classification":
        limit = _max_positions(config)
        seq = seq or min(128, limit or 128)
        if limit is not None and seq > limit:
            raise ValueError(f"MODEL {spec!r}: seq={seq} is longer than the model's {limit} positions; "
                             f"give seq={limit} or less")
    config_dict = weights.config_dict(config)
    model = weights.build_meta(config_dict, architecture)
    if pretrained is not None and not weights.check_shapes(model, pretrained):
        raise ValueError(f"--pretrained {pretrained}: none of its tensors is a tensor of {architecture} (by name, "
                         "with or without the base model's prefix): pass the weights of this model")
    if device is None:
        device = "meta" if _state_bytes(model) > META_THRESHOLD_BYTES else "cpu"
    if device == "cpu":
        model = _materialized(model, config, architecture, seed, pretrained)
    model.train()
    example_args, make_batch, loss_fn, batch_src, loss_src = _data(task, config, seq=seq, batch=batch, seed=seed,
                                                                   spec=spec, image=image)
    if device == "meta":
        example_args = tuple(a.to("meta") for a in example_args)
    # the ranks and `partitioner export` build the model of the user's config (its own use_cache: what
    # an exported model generates with); only the trace ran without the cache
    init_config = config_dict if use_cache is None else {**config_dict, "use_cache": use_cache}
    init = ("runtime.execute.pretrained:hf_weights", {"config": init_config, "architecture": architecture, "seed": seed,
                                                **({"pretrained": pretrained} if pretrained else {})})
    return Workload(model=model, example_args=example_args, loss_fn=loss_fn, make_batch=make_batch,
                    name=f"hf:{Path(name).name}({architecture}, task={task}, seq={seq})",
                    source={"make_batch": batch_src, "loss_fn": loss_src, "init": init})


@contextlib.contextmanager
def no_progress_bars():
    """transformers' loading and saving bars would land between compile's (and export's) lines."""
    # lazy: loads transformers (the [hf] extra)
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def _materialized(model, config, architecture: str, seed: int, pretrained: str | None):
    """The whole model on the CPU: its own initialisation, or ``from_pretrained`` (with what the
    files lack made as the ranks make it)."""
    # lazy: loads transformers (the [hf] extra)
    import transformers

    names = list(weights.aliases(model))
    if pretrained is None:
        weights.initial_weights(model, names, seed)  # materialises the model in place
        return model
    with no_progress_bars():
        loaded, info = getattr(transformers, architecture).from_pretrained(
            pretrained, config=config, local_files_only=True, dtype=torch.float32, output_loading_info=True,
            trust_remote_code=False)  # Note [no remote code]
    missing = [n for n in info.get("missing_keys", ()) if n in names]
    if missing:
        own = weights.initial_weights(weights.build_meta(weights.config_dict(config),
                                                         architecture), missing, seed)
        with torch.no_grad():
            for name in missing:
                owner, leaf = weights.owner_of(loaded, name)
                getattr(owner, leaf).copy_(own[name])
    return loaded
