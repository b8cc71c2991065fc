"""The built-in ``gpt``'s trained weights as transformers' ``GPT2LMHeadModel``, for `export`.

Note [the built-in gpt is GPT-2]: partitioner/models/builtin.py's GPT is GPT-2's math exactly:
pre-norm blocks (LayerNorm eps 1e-5), learned positions, attention scaled by 1/sqrt(head dim)
with a causal mask, a 4x MLP, biases everywhere but the head. Three things differ only in
layout or setting, and are mapped here, never approximated:
- the fused qkv is Megatron's per-head layout (each head's q, k, v rows together, so tensor
  parallelism slices whole heads); GPT-2's c_attn is all q, then all k, then all v: a row
  permutation;
- GPT-2's Conv1D stores (in, out), nn.Linear (out, in): a transpose;
- the activation is exact GELU (``activation_function="gelu"``, not GPT-2's tanh ``gelu_new``)
  and the head is untied (``tie_word_embeddings=False``).
The heads count is no tensor's shape, so it is read from the workload's name in plan.json; the
names and shapes of the checkpoint must then be exactly the GPT's, or nothing is converted.
tests/unit/test_export_gpt2.py loads the export with from_pretrained and compares logits.
"""

from __future__ import annotations

import re

import torch

ARCHITECTURE = "GPT2LMHeadModel"
_NAME = re.compile(r"gpt\(([^()]*)\)")


def gpt_args(workload_name: str | None) -> dict | None:
    """The built-in GPT's arguments from its workload name (``gpt(layers=2,...,dropout=0.0)``,
    partitioner/models/builtin.py:gpt), or None for any other model."""
    m = _NAME.fullmatch(workload_name or "")
    if not m:
        return None
    args = dict(item.split("=", 1) for item in m.group(1).split(",") if "=" in item)
    try:
        return {**{k: int(args[k]) for k in ("layers", "width", "heads", "vocab", "seq")},
                "dropout": float(args.get("dropout", 0.0))}
    except (KeyError, ValueError):
        return None


def _gpt_shapes(layers: int, width: int, vocab: int, seq: int, **_) -> dict[str, tuple[int, ...]]:
    shapes = {"tok_emb.weight": (vocab, width), "pos_emb.weight": (seq, width), "ln_f.weight": (width,),
              "ln_f.bias": (width,), "head.weight": (vocab, width)}
    per_block = {"ln_1.weight": (width,), "ln_1.bias": (width,), "attn.qkv.weight": (3 * width, width),
                 "attn.qkv.bias": (3 * width,), "attn.proj.weight": (width, width), "attn.proj.bias": (width,),
                 "ln_2.weight": (width,), "ln_2.bias": (width,), "mlp.fc.weight": (4 * width, width),
                 "mlp.fc.bias": (4 * width,), "mlp.proj.weight": (width, 4 * width), "mlp.proj.bias": (width,)}
    for i in range(layers):
        shapes.update({f"blocks.{i}.{name}": shape for name, shape in per_block.items()})
    return shapes


def mismatch(state: dict[str, torch.Tensor], args: dict) -> str | None:
    """Why ``state`` is not the built-in GPT of ``args`` (a name or shape off), or None."""
    want = _gpt_shapes(**args)
    if set(state) != set(want):
        odd = sorted(set(state) ^ set(want))
        return f"its tensors are not the built-in gpt's (e.g. {odd[0]})"
    off = next((n for n, t in sorted(state.items()) if tuple(t.shape) != want[n]), None)
    return None if off is None else f"{off} is {list(state[off].shape)}, the built-in gpt's is {list(want[off])}"


def gpt2_config(args: dict):
    # lazy: loads transformers (the [hf] extra)
    import transformers

    return transformers.GPT2Config(
        vocab_size=args["vocab"], n_positions=args["seq"], n_embd=args["width"], n_layer=args["layers"],
        n_head=args["heads"], n_inner=4 * args["width"], activation_function="gelu", layer_norm_epsilon=1e-5,
        resid_pdrop=args["dropout"], embd_pdrop=args["dropout"], attn_pdrop=args["dropout"],
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, use_cache=True)


def gpt2_state(state: dict[str, torch.Tensor], args: dict) -> dict[str, torch.Tensor]:
    """``state`` (the built-in GPT's names) by GPT2LMHeadModel's names and layouts."""
    width, heads = args["width"], args["heads"]
    head_dim = width // heads

    def qkv(t: torch.Tensor) -> torch.Tensor:
        # rows (head, q|k|v, head_dim) -> (q|k|v, head, head_dim); the trailing dims ride along
        return t.reshape(heads, 3, head_dim, *t.shape[1:]).transpose(0, 1).reshape(t.shape)

    out = {"transformer.wte.weight": state["tok_emb.weight"], "transformer.wpe.weight": state["pos_emb.weight"],
           "transformer.ln_f.weight": state["ln_f.weight"], "transformer.ln_f.bias": state["ln_f.bias"],
           "lm_head.weight": state["head.weight"]}
    for i in range(args["layers"]):
        src, dst = f"blocks.{i}.", f"transformer.h.{i}."
        for ln in ("ln_1", "ln_2"):
            out[f"{dst}{ln}.weight"], out[f"{dst}{ln}.bias"] = state[f"{src}{ln}.weight"], state[f"{src}{ln}.bias"]
        out[f"{dst}attn.c_attn.weight"] = qkv(state[f"{src}attn.qkv.weight"]).t()
        out[f"{dst}attn.c_attn.bias"] = qkv(state[f"{src}attn.qkv.bias"])
        for ours, theirs in (("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")):
            out[f"{dst}{theirs}.weight"] = state[f"{src}{ours}.weight"].t()
            out[f"{dst}{theirs}.bias"] = state[f"{src}{ours}.bias"]
    return {name: t.detach().contiguous() for name, t in out.items()}


def gpt2_model(state: dict[str, torch.Tensor], args: dict):
    """A GPT2LMHeadModel holding ``state`` (the built-in GPT's trained weights), every tensor
    placed (strict): what `export` saves with save_pretrained."""
    # lazy: loads transformers (the [hf] extra)
    import transformers

    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(gpt2_config(args))
    model.load_state_dict(gpt2_state(state, args), strict=True, assign=True)
    return model
