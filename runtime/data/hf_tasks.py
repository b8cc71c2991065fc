"""Synthetic, deterministic batches and losses for the Hugging Face tasks other than causal LM
(which uses runtime/data/synthetic.py): masked LM, image classification, seq2seq. Every batch is a pure
function of (seed, step) (Note [data is a function of the step] in runtime/data/synthetic.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100  # a label the loss skips (Hugging Face's convention)


def _gen(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def masked_token_batch(step: int, batch_size: int, *, vocab: int, seq: int, mask_token_id: int,
                       seed: int = 0, mask_fraction: float = 0.15):
    """``(tokens,)`` with ~15% of positions replaced by ``mask_token_id``, and labels that hold the
    original token there and IGNORE elsewhere (at least one masked position per row)."""
    gen = _gen(seed, step)
    tokens = torch.randint(0, vocab, (batch_size, seq), generator=gen)
    masked = torch.rand(batch_size, seq, generator=gen) < mask_fraction
    masked[:, 0] |= ~masked.any(dim=1)
    labels = torch.where(masked, tokens, torch.full_like(tokens, IGNORE))
    return (torch.where(masked, torch.full_like(tokens, mask_token_id), tokens),), labels


def masked_lm_loss(output, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over the masked positions (a Hugging Face output's ``.logits``)."""
    logits = getattr(output, "logits", output)
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=IGNORE)


def image_batch(step: int, batch_size: int, *, channels: int, size: int, num_labels: int, seed: int = 0):
    """``(pixel_values,)`` [batch, channels, size, size] ~ N(0, 1) and integer labels."""
    gen = _gen(seed, step)
    pixels = torch.randn(batch_size, channels, size, size, generator=gen)
    return (pixels,), torch.randint(0, num_labels, (batch_size,), generator=gen)


def classification_loss(output, labels: torch.Tensor) -> torch.Tensor:
    logits = getattr(output, "logits", output)
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    return F.cross_entropy(logits.float(), labels)


def seq2seq_batch(step: int, batch_size: int, *, vocab: int, seq: int, start_token_id: int, seed: int = 0):
    """``(input_ids, attention_mask, decoder_input_ids)`` and labels: the decoder learns to copy the
    input, fed the labels shifted right behind ``start_token_id`` (teacher forcing)."""
    gen = _gen(seed, step)
    tokens = torch.randint(0, vocab, (batch_size, seq), generator=gen)
    start = torch.full((batch_size, 1), start_token_id, dtype=tokens.dtype)
    decoder = torch.cat([start, tokens[:, :-1]], dim=1)
    return (tokens, torch.ones_like(tokens), decoder), tokens.clone()
