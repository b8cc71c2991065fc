"""Built-in workloads and the MODEL spec that names a workload on the command line.

A spec is a built-in name with optional arguments (``gpt``, ``gpt:layers=12,width=256``),
``package.module:function`` or ``path/to/file.py:function``; the function returns a Workload.
"""

from __future__ import annotations

import functools
import importlib
import math
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from partitioner.frontend.user_source import load_model_file
from partitioner.frontend.workload import Workload
from runtime.data import synthetic as data

# Build on the meta device above this many bytes of training state (weights, grads, AdamW):
# such a model is compiled, never materialized whole in one process.
META_THRESHOLD_BYTES = 4 * 2**30


class CausalSelfAttention(nn.Module):
    """``attn="sdpa"``: torch's fused kernel (flash attention on a GPU); ``"eager"``: the scores
    written out (q k^T, mask, softmax, dropout, times v), as Megatron-LM ran attention before
    flash attention, so the memory-bound passes over the heads x seq x seq scores are in the graph
    (benchmarks/published_runs.py prices the paper's runs with it)."""

    def __init__(self, width: int, heads: int, dropout: float, attn: str = "sdpa"):
        super().__init__()
        if attn not in ("sdpa", "eager"):
            raise ValueError(f"gpt: attn={attn!r} is not \"sdpa\" or \"eager\"")
        self.heads, self.dropout, self.attn_impl = heads, dropout, attn
        self.attn_drop = nn.Dropout(dropout)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        # Megatron's fused layout: qkv's rows grouped by head (each head's q, k, v together), so a
        # tensor group's contiguous slice of them is whole heads and the projection shards
        # column-wise (Note [tensor-parallel roles] in passes/tp_roles.py)
        per_head = self.qkv(x).view(batch, seq, self.heads, 3 * (width // self.heads))
        q, k, v = (t.transpose(1, 2) for t in per_head.split(width // self.heads, dim=3))
        if self.attn_impl == "eager":
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
            causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
            y = self.attn_drop(scores.masked_fill(causal, float("-inf")).softmax(dim=-1)) @ v
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
            )
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(batch, seq, width)))


class MLP(nn.Module):
    def __init__(self, width: int, dropout: float):
        super().__init__()
        self.fc = nn.Linear(width, 4 * width)
        self.proj = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float, attn: str = "sdpa"):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, dropout, attn)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = MLP(width, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A GPT-2-style decoder (pre-norm blocks, learned positions, untied head)."""

    def __init__(self, *, layers: int, width: int, heads: int, vocab: int, seq: int, dropout: float,
                 attn: str = "sdpa"):
        super().__init__()
        if width % heads:
            raise ValueError(f"gpt: width={width} is not divisible by heads={heads}: pick heads dividing width")
        self.tok_emb = nn.Embedding(vocab, width)
        self.pos_emb = nn.Embedding(seq, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(width, heads, dropout, attn) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.tok_emb(tokens) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def gpt_param_count(*, layers: int, width: int, vocab: int, seq: int) -> int:
    return layers * (12 * width * width + 13 * width) + (vocab + seq) * width + 2 * width + vocab * width


def gpt(layers: int = 4, width: int = 128, heads: int = 4, vocab: int = 512, seq: int = 64,
        dropout: float = 0.0, batch: int = 2, seed: int = 0, device: str | None = None,
        attn: str = "sdpa") -> Workload:
    """The embedded default: small enough to train on two CPU cores in seconds. ``attn``: "sdpa"
    (torch's fused attention) or "eager" (the scores written out: CausalSelfAttention)."""
    params = gpt_param_count(layers=layers, width=width, vocab=vocab, seq=seq)
    if device is None:
        device = "meta" if params * 16 > META_THRESHOLD_BYTES else "cpu"
    torch.manual_seed(seed)
    with torch.device(device):
        model = GPT(layers=layers, width=width, heads=heads, vocab=vocab, seq=seq, dropout=dropout, attn=attn)
    tokens = torch.zeros(batch, seq, dtype=torch.long, device=device)
    return Workload(
        model=model,
        example_args=(tokens,),
        loss_fn=data.causal_lm_loss,
        make_batch=functools.partial(data.token_batch, vocab=vocab, seq=seq, seed=seed),
        name=f"gpt(layers={layers},width={width},heads={heads},vocab={vocab},seq={seq},dropout={dropout}"
             + (f",attn={attn}" if attn != "sdpa" else "") + ")",
        source={"make_batch": ("runtime.data.synthetic:token_batch", {"vocab": vocab, "seq": seq, "seed": seed}),
                "loss_fn": ("runtime.data.synthetic:causal_lm_loss", {})},
    )


class MLPModel(nn.Module):
    def __init__(self, features: int, hidden: int, depth: int, outputs: int):
        super().__init__()
        dims = [features] + [hidden] * depth
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))
        self.out = nn.Linear(dims[-1], outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.out(x)


def mlp(features: int = 32, hidden: int = 64, depth: int = 4, outputs: int = 8, batch: int = 4,
        seed: int = 0) -> Workload:
    torch.manual_seed(seed)
    model = MLPModel(features, hidden, depth, outputs)
    return Workload(
        model=model,
        example_args=(torch.zeros(batch, features),),
        loss_fn=data.mse_loss,
        make_batch=functools.partial(data.regression_batch, features=features, outputs=outputs, seed=seed),
        name=f"mlp(features={features},hidden={hidden},depth={depth},outputs={outputs})",
        source={"make_batch": ("runtime.data.synthetic:regression_batch",
                               {"features": features, "outputs": outputs, "seed": seed}),
                "loss_fn": ("runtime.data.synthetic:mse_loss", {})},
    )


def _hf(kind: str, *, layers: int, width: int, heads: int, vocab: int, seq: int, batch: int,
        seed: int, attn: str, device: str, dropout: float = 0.0, experts: int = 4, top_k: int = 2) -> Workload:
    # lazy: loads transformers (the [hf] extra)
    import transformers

    common = dict(use_cache=False, attn_implementation=attn)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab,
                                         n_positions=seq, bos_token_id=0, eos_token_id=0,
                                         resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, **common)
        cls = transformers.GPT2LMHeadModel
    elif kind == "llama":
        config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=width,
                                          num_attention_heads=heads, num_key_value_heads=heads,
                                          intermediate_size=int(width * 8 / 3) // 8 * 8 or 8,
                                          vocab_size=vocab, max_position_embeddings=seq,
                                          bos_token_id=0, eos_token_id=0, pad_token_id=0,
                                          attention_dropout=dropout, **common)
        cls = transformers.LlamaForCausalLM
    elif kind == "bert":
        config = transformers.BertConfig(num_hidden_layers=layers, hidden_size=width,
                                         num_attention_heads=heads, intermediate_size=4 * width,
                                         vocab_size=vocab, max_position_embeddings=seq, pad_token_id=0,
                                         hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                                         **common)
        cls = transformers.BertForMaskedLM
    elif kind == "qwen2-moe":
        # A mixture of experts: its expert matmuls run through transformers' own custom op
        # (Note [custom ops travel] in partitioner/codegen/stage_code.py).
        config = transformers.Qwen2MoeConfig(num_hidden_layers=layers, hidden_size=width,
                                             num_attention_heads=heads, num_key_value_heads=heads,
                                             intermediate_size=2 * width, moe_intermediate_size=width // 2,
                                             shared_expert_intermediate_size=width, num_experts=experts,
                                             num_experts_per_tok=top_k, vocab_size=vocab,
                                             max_position_embeddings=seq, bos_token_id=0, eos_token_id=0,
                                             pad_token_id=0, attention_dropout=dropout, **common)
        cls = transformers.Qwen2MoeForCausalLM
    else:
        raise ValueError(f"unknown Hugging Face model kind {kind!r}: use gpt2, llama, bert or qwen2-moe")
    torch.manual_seed(seed)
    with torch.device(device):
        model = cls(config)
    model.train()
    tokens = torch.zeros(batch, seq, dtype=torch.long, device=device)
    # On meta, every rank makes its weights by the model's own initialisation (Note [own
    # initialisation per rank] in runtime/execute/pretrained.py); on cpu they are this model's.
    from runtime.execute.pretrained import config_dict

    init = {"init": ("runtime.execute.pretrained:hf_weights", {"config": config_dict(config),
                                                       "architecture": cls.__name__, "seed": seed})
            } if device == "meta" else {}
    return Workload(
        model=model,
        example_args=(tokens,),
        loss_fn=data.causal_lm_loss,
        make_batch=functools.partial(data.token_batch, vocab=vocab, seq=seq, seed=seed),
        name=f"hf-{kind}(layers={layers},width={width},heads={heads},vocab={vocab},seq={seq},attn={attn})",
        source={"make_batch": ("runtime.data.synthetic:token_batch", {"vocab": vocab, "seq": seq, "seed": seed}),
                "loss_fn": ("runtime.data.synthetic:causal_lm_loss", {}), **init},
    )


def hf_gpt2(layers=2, width=64, heads=4, vocab=256, seq=32, batch=2, seed=0, attn="sdpa", device="cpu",
           dropout=0.0):
    return _hf("gpt2", layers=layers, width=width, heads=heads, vocab=vocab, seq=seq, batch=batch,
               seed=seed, attn=attn, device=device, dropout=dropout)


def hf_llama(layers=2, width=64, heads=4, vocab=256, seq=32, batch=2, seed=0, attn="sdpa", device="cpu",
           dropout=0.0):
    return _hf("llama", layers=layers, width=width, heads=heads, vocab=vocab, seq=seq, batch=batch,
               seed=seed, attn=attn, device=device, dropout=dropout)


def hf_bert(layers=2, width=64, heads=4, vocab=256, seq=32, batch=2, seed=0, attn="sdpa", device="cpu",
           dropout=0.0):
    return _hf("bert", layers=layers, width=width, heads=heads, vocab=vocab, seq=seq, batch=batch,
               seed=seed, attn=attn, device=device, dropout=dropout)


def hf_qwen2_moe(layers=2, width=64, heads=4, vocab=256, seq=32, batch=2, seed=0, attn="sdpa", device="cpu",
                 dropout=0.0, experts=4, top_k=2):
    return _hf("qwen2-moe", layers=layers, width=width, heads=heads, vocab=vocab, seq=seq, batch=batch,
               seed=seed, attn=attn, device=device, dropout=dropout, experts=experts, top_k=top_k)


BUILTINS = {"gpt": gpt, "mlp": mlp, "hf-gpt2": hf_gpt2, "hf-llama": hf_llama, "hf-bert": hf_bert,
            "hf-qwen2-moe": hf_qwen2_moe}


# Lower bounds of the built-ins' numeric arguments (the rest: seed >= 0, dropout in [0, 1)).
_AT_LEAST = {"layers": 1, "width": 1, "heads": 1, "vocab": 1, "seq": 1, "batch": 1, "features": 1,
             "hidden": 1, "depth": 0, "outputs": 1, "experts": 1, "top_k": 1, "seed": 0}


def _check_builtin_args(spec: str, name: str, kwargs: dict) -> None:
    """Types and ranges of a built-in's arguments, checked before anything is built: the value,
    what it must be, and an example."""
    # here, not at the top: tests/golden/program_stage_*.py quote this file's line numbers above
    import inspect

    params = inspect.signature(BUILTINS[name]).parameters
    for key, value in kwargs.items():
        if key not in params:
            continue  # the call below names the unknown argument and the known ones
        default = params[key].default
        if isinstance(default, bool) or default is None or isinstance(default, str):
            continue
        if isinstance(default, int):
            if not isinstance(value, int):
                raise ValueError(f"MODEL {spec!r}: {key}={value} is not a whole number; "
                                 f"give e.g. {name}:{key}={default}")
            low = _AT_LEAST.get(key, 1)
            if value < low:
                raise ValueError(f"MODEL {spec!r}: {key}={value} must be at least {low}; "
                                 f"give e.g. {name}:{key}={max(default, low)}")
        elif isinstance(default, float):
            if not isinstance(value, (int, float)):
                raise ValueError(f"MODEL {spec!r}: {key}={value} is not a number; give e.g. {name}:{key}={default}")
            if key == "dropout" and not 0.0 <= value < 1.0:
                raise ValueError(f"MODEL {spec!r}: dropout={value} must be in [0, 1); give e.g. {name}:dropout=0.1")
            kwargs[key] = float(value)
    if "top_k" in kwargs or "experts" in kwargs:
        experts = kwargs.get("experts", params["experts"].default if "experts" in params else None)
        top_k = kwargs.get("top_k", params["top_k"].default if "top_k" in params else None)
        if experts is not None and top_k is not None and top_k > experts:
            raise ValueError(f"MODEL {spec!r}: top_k={top_k} is more than experts={experts}; "
                             f"give top_k <= experts")
    width = kwargs.get("width", params["width"].default if "width" in params else None)
    heads = kwargs.get("heads", params["heads"].default if "heads" in params else None)
    if width is not None and heads is not None and width % heads:
        raise ValueError(f"MODEL {spec!r}: width={width} is not divisible by heads={heads}; "
                         f"pick heads dividing width (e.g. {name}:width={width},heads={_divisor(width, heads)})")


def _divisor(width: int, heads: int) -> int:
    return max(d for d in range(1, min(width, heads) + 1) if width % d == 0)


def _parse_value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def load_workload(spec: str, *, pretrained: str | None = None, data: str | None = None) -> Workload:
    """Resolve a MODEL spec to a Workload, with an error that names the spec and the fix.
    ``pretrained``: a folder of Hugging Face safetensors for an ``hf:`` spec (partitioner/models/hf.py).
    ``data``: the corpus the model will train on; a built-in gpt without ``vocab=`` takes its
    vocabulary (the compile then trains on it: partitioner/frontend/corpus_data.py)."""
    name, _, rest = spec.partition(":")
    if name == "hf":  # a Hugging Face config by folder or cached name (partitioner/models/hf.py)
        from partitioner.models.hf import hf_workload, parse_spec

        hf_name, options = parse_spec(spec)
        if pretrained is not None:
            options["pretrained"] = pretrained
        return hf_workload(hf_name, spec=spec, **options)
    if pretrained is not None:
        raise ValueError(f"--pretrained reads Hugging Face safetensors into an hf: model; MODEL {spec!r} is not "
                         "one: give MODEL as hf:CONFIG_DIR")
    if name in BUILTINS:
        kwargs = {}
        for item in filter(None, rest.split(",")):
            key, eq, value = item.partition("=")
            if not eq:
                raise ValueError(f"MODEL {spec!r}: argument {item!r} is not key=value (e.g. gpt:layers=12,width=256)")
            kwargs[key.strip()] = _parse_value(value.strip())
        _check_builtin_args(spec, name, kwargs)
        if data is not None and name == "gpt" and "vocab" not in kwargs:
            from partitioner.frontend.corpus_data import corpus_vocab  # here: golden stage files quote line numbers

            kwargs["vocab"] = corpus_vocab(data)
        try:
            return BUILTINS[name](**kwargs)
        except TypeError as exc:
            import inspect  # here, not at the top: the golden stage files quote this file's line numbers

            known = ", ".join(inspect.signature(BUILTINS[name]).parameters)
            raise ValueError(f"MODEL {spec!r}: {exc}; {name} takes {known}") from None
    if not rest:
        raise ValueError(
            f"MODEL {spec!r} is not a built-in ({', '.join(BUILTINS)}) nor module:function or file.py:function"
        )
    from runtime.errors import import_failure  # here, not at the top: the golden stage files quote line numbers

    if name.endswith(".py"):
        path = Path(name)
        if not path.is_file():
            raise ValueError(f"MODEL {spec!r}: file {name} does not exist")
        module = load_model_file(path, spec)  # as `python my_model.py` runs it (Note [local modules travel])
    else:
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - Note [the real import error] in runtime/errors.py
            raise ValueError(f"MODEL {spec!r}: cannot import {name}: {import_failure(exc)}") from None
    function = getattr(module, rest, None)
    if function is None:
        raise ValueError(f"MODEL {spec!r}: {name} has no function {rest!r}")
    try:
        workload = function()
    except Exception as exc:  # noqa: BLE001 - the user's builder; report it in their terms
        raised = import_failure(exc) if exc.__cause__ is not None else f"{type(exc).__name__}: {exc}"
        raise ValueError(f"MODEL {spec!r}: {rest}() raised {raised}; it must build "
                         "and return a Workload when called with no arguments") from exc
    if not isinstance(workload, Workload):
        raise ValueError(f"MODEL {spec!r}: {rest}() returned {type(workload).__name__}, expected a Workload")
    return workload
