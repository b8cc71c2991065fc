"""`partitioner generate DIR --prompt TEXT`: text sampled from a causal language model's newest
verified checkpoint, in one process.

The unpartitioned model is rebuilt from plan.json's MODEL spec (as `partitioner verify` rebuilds
it), given the checkpoint's consolidated weights (export.py's ``trained_state``: every shard
verified), and sampled token by token with no gradients; the prompt is encoded and the output
decoded with the tokenizer of the data the program trained on (text_codec.py).

Note [no key/value cache]: each new token runs the model over the whole (cropped) context. The
rebuilt model is whatever the plan names (a built-in GPT, a user's module, a transformers class),
and only transformers models keep a cache; one loop for all of them costs a factor of the context
length in compute, which for the models a CPU checks by hand is milliseconds per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from partitioner.config.settings import settings_of
from partitioner.models.builtin import load_workload
from partitioner.models.export import committed_steps, hf_model, is_hf, trained_state
from partitioner.models.text_codec import codec_for, make_batch_kwargs
from runtime.program.spec import load_plan

CAUSAL_LM_LOSS = "runtime.data.synthetic:causal_lm_loss"  # what every causal LM the compiler builds trains with
CAUSAL_ARCHITECTURES = ("ForCausalLM", "LMHeadModel")  # transformers' class-name suffixes of causal LMs
MIN_TEMPERATURE = 1e-30  # float32 logits of |x| <= 1e8 divided by it stay finite; below, use 0 (greedy)


@dataclass(frozen=True)
class SamplingSettings:
    """How tokens are drawn. ``temperature`` 0: greedy (the argmax; deterministic). ``top_k`` 0:
    every token of the vocabulary may be drawn."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    seed: int = 0
    device: str = "cpu"

    def __post_init__(self):
        if self.max_new_tokens < 0:
            raise ValueError(f"--max-new-tokens {self.max_new_tokens}: must be 0 or more (e.g. 64)")
        if not 0 <= self.temperature < float("inf"):
            raise ValueError(f"--temperature {self.temperature}: must be 0 (greedy) or more (e.g. 0.8)")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"--temperature {self.temperature:g}: under {MIN_TEMPERATURE:g}, float32 logits divided "
                             "by it overflow to inf and the draw is undefined; give 0 for greedy (what such a "
                             "temperature means) or 1e-30 or more")
        if self.top_k < 0:
            raise ValueError(f"--top-k {self.top_k}: must be 0 (off) or more (e.g. 50)")
        if not 0 <= self.seed < 1 << 64:  # torch.Generator takes 64 bits; more was an OverflowError mid-run
            raise ValueError(f"--seed {self.seed}: give a whole number from 0 to 2**64 - 1 (e.g. 1)")
        try:
            kind = torch.device(self.device).type
        except (RuntimeError, ValueError):  # torch's message lists every backend and names no flag
            raise ValueError(f"--device {self.device}: not a torch device; give cpu, cuda or cuda:N") from None
        if kind == "meta":
            raise ValueError(f"--device {self.device}: meta tensors hold shapes and no values, so nothing can be "
                             "sampled on it; give cpu, cuda or cuda:N")


@dataclass(frozen=True)
class TrainedModel:
    """The unpartitioned model of a program folder holding one checkpoint's weights, in eval mode."""

    model: torch.nn.Module
    step: int
    checkpoint: Path
    seq_len_tokens: int  # the context it trained on: longer ones are cropped to their last tokens
    vocab_size: int
    make_batch: object  # the program's data.make_batch spec: where its tokenizer comes from
    skipped: tuple[str, ...] = ()


@dataclass(frozen=True)
class Generated:
    text: str  # the prompt followed by the generated text
    prompt_ids: tuple[int, ...]
    new_ids: tuple[int, ...]
    step: int
    checkpoint: Path
    notes: tuple[str, ...] = field(default=())  # one line each, for stderr


def _name(spec) -> str | None:
    return spec if isinstance(spec, str) else (spec[0] if spec else None)


def refuse_unless_causal(plan_json: dict, folder: Path) -> None:
    """A causal LM trains with the causal LM loss, or is a transformers *ForCausalLM / *LMHeadModel."""
    program = plan_json["program"]
    weights = (program.get("init") or {}).get("weights")
    if is_hf(weights):
        architecture = weights[1]["architecture"]
        if architecture.endswith(CAUSAL_ARCHITECTURES):
            return
        raise ValueError(f"generate {folder}: its model is a {architecture}, not a causal language model "
                         f"(*{' or *'.join(CAUSAL_ARCHITECTURES)}): generate samples only from those")
    loss = _name(program["data"]["loss_fn"])
    if loss != CAUSAL_LM_LOSS:
        spec = (plan_json.get("training") or {}).get("model_spec") or "its model"
        raise ValueError(f"generate {folder}: {spec} trains with {loss}, not {CAUSAL_LM_LOSS}: it is no causal "
                         "language model, and generate samples only from those (e.g. gpt:..., hf:CONFIG_DIR)")


def _seq_len(plan_json: dict) -> int:
    """make_batch's ``seq`` (the synthetic tokens' and the corpus's), else stage 0's input length."""
    seq = make_batch_kwargs(plan_json["program"]["data"]["make_batch"]).get("seq")
    if isinstance(seq, int) and seq > 0:
        return seq
    return int(plan_json["program"]["stages"][0]["inputs"][0]["shape"][-1])


def _weights_into(model: torch.nn.Module, state: dict[str, torch.Tensor], spec: str) -> torch.nn.Module:
    """The checkpoint's tensors into the model rebuilt from ``spec``; every parameter must be in it."""
    on_meta = any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    if on_meta:  # too large to initialise on the CPU at build: the checkpoint gives every value
        model = model.to_empty(device="cpu")
    missing, unexpected = model.load_state_dict(state, strict=False)
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    lost = [n for n in missing if n in params or on_meta]
    if unexpected or lost:
        what = f"holds {unexpected[:3]}, which the model does not have" if unexpected else f"lacks {lost[:3]}"
        raise ValueError(f"the checkpoint {what}: it is not a checkpoint of {spec}; pass the program "
                         "folder that wrote it")
    return model


def logits_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """[batch, seq, vocab] of a causal LM: a tensor (built-in GPT), or a transformers output's logits."""
    out = model(tokens)
    out = getattr(out, "logits", out)
    if isinstance(out, (tuple, list)):
        out = out[0]
    if not isinstance(out, torch.Tensor) or out.dim() != 3 or out.shape[:2] != tokens.shape:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"the model returned {shape} for tokens of shape {tuple(tokens.shape)}, not logits "
                         "[batch, seq, vocab]: generate needs a causal LM's logits")
    return out


def load_trained(folder, *, checkpoint_dir=None, step: int | None = None, device: str = "cpu") -> TrainedModel:
    """The model of program folder ``folder`` with checkpoint ``step`` (None: the newest committed)
    of ``checkpoint_dir`` (default DIR/checkpoints)."""
    folder = Path(folder)
    if not (folder / "plan.json").is_file():
        raise ValueError(f"generate {folder}: no plan.json there: pass a program folder (`partitioner compile "
                         "MODEL -o DIR` writes one)")
    plan_json = load_plan(str(folder))
    refuse_unless_causal(plan_json, folder)
    settings = settings_of(plan_json)
    weights_spec = (plan_json["program"].get("init") or {}).get("weights")
    if not settings.model_spec and not is_hf(weights_spec):
        raise ValueError(f"generate {folder}: it was compiled from a Workload object in Python, so its model cannot "
                         "be rebuilt here: compile it from a MODEL spec (gpt:..., module:function, hf:CONFIG_DIR)")
    ckpt = Path(checkpoint_dir) if checkpoint_dir else folder / "checkpoints"
    if not committed_steps(ckpt):
        flag = f" --checkpoint-dir {ckpt}" if checkpoint_dir else ""
        raise ValueError(f"generate {folder}: no verified checkpoint in {ckpt} yet (no step_N with a manifest.json): "
                         f"train it first, `partitioner run {folder} --steps N{flag}` leaves one of its last step")
    trained = trained_state(ckpt, folder, step)
    if is_hf(weights_spec):
        model, _ = hf_model(trained.state, weights_spec)
    else:
        spec = settings.model_spec
        model = _weights_into(load_workload(spec, pretrained=settings.pretrained, data=settings.data).model, trained.state, spec)
    model = model.to(device).eval()
    with torch.no_grad():
        vocab = logits_of(model, torch.zeros(1, 1, dtype=torch.long, device=device)).shape[-1]
    return TrainedModel(model, trained.step, trained.checkpoint, _seq_len(plan_json), int(vocab),
                        plan_json["program"]["data"]["make_batch"], trained.skipped)


@torch.no_grad()
def sample(model: torch.nn.Module, prompt_ids, settings: SamplingSettings, *, seq_len_tokens: int,
           vocab_size: int, eod_id: int | None = None) -> list[int]:
    """Up to ``max_new_tokens`` ids after ``prompt_ids`` (Note [no key/value cache]), drawn among
    the first ``vocab_size`` (Note [sampling within the tokenizer's vocabulary] in text_codec.py);
    stops after an ``eod_id``, which is not returned."""
    device = torch.device(settings.device)
    generator = torch.Generator(device=device).manual_seed(settings.seed)
    tokens = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    new: list[int] = []
    for _ in range(settings.max_new_tokens):
        logits = logits_of(model, tokens[:, -seq_len_tokens:])[0, -1, :vocab_size].float()
        if settings.temperature == 0:
            token = int(torch.argmax(logits))
        else:
            logits = logits / settings.temperature
            if settings.top_k:
                floor = torch.topk(logits, min(settings.top_k, logits.shape[0])).values[-1]
                logits = logits.masked_fill(logits < floor, float("-inf"))
            token = int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))
        if token == eod_id:
            break
        new.append(token)
        tokens = torch.cat([tokens, torch.tensor([[token]], dtype=torch.long, device=device)], dim=1)
    return new


def generate(folder, prompt: str, settings: SamplingSettings = SamplingSettings(), *, checkpoint_dir=None,
             step: int | None = None, tokenizer_from: str | None = None) -> Generated:
    """The prompt and what the model of ``folder`` writes after it, decoded with the data's tokenizer."""
    if not prompt:
        raise ValueError("--prompt is empty: give at least one character for the model to continue")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:  # argv bytes that are not UTF-8 arrive as lone surrogates
        code = ord(prompt[exc.start])
        what = f"byte {code - 0xdc00:#04x}" if 0xdc80 <= code <= 0xdcff else f"{prompt[exc.start]!r}"
        raise ValueError(f"--prompt: {what} at character {exc.start + 1} is not UTF-8 text: give the prompt in "
                         "UTF-8 (check the terminal's locale, or iconv -t utf-8)") from None
    if settings.device != "cpu" and torch.device(settings.device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {settings.device}: no CUDA device here: pass --device cpu")
    trained = load_trained(folder, checkpoint_dir=checkpoint_dir, step=step, device=settings.device)
    codec, notes = codec_for(trained.make_batch, tokenizer_from, trained.vocab_size)
    prompt_ids = codec.encode(prompt)
    codec.check_fits(prompt_ids, prompt, trained.vocab_size)
    new = sample(trained.model, prompt_ids, settings, seq_len_tokens=trained.seq_len_tokens,
                 vocab_size=min(codec.vocab_size, trained.vocab_size), eod_id=codec.eod_id)
    notes += tuple(f"not used: {why}" for why in trained.skipped)
    return Generated(prompt + codec.continuation(prompt_ids, new), tuple(prompt_ids), tuple(new), trained.step,
                     trained.checkpoint, notes)
