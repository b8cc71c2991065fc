"""A workload made to train on a token corpus (``--data SPEC``, ``[data] source``, ``training.data``).

Note [a corpus replaces make_batch]: the corpus does not add a data path beside make_batch, it
becomes one: the workload's make_batch is the corpus's (runtime/data/corpus/batches.py), so the
trace, the oracle, `verify` and every rank read the same samples through the one interface. Two
optional roles ride along in the program's data (``DataSpec.rows``, ``DataSpec.eval_batch``): a
rank reads only the rows its stages use (Note [a rank reads its rows] in runtime/execute/train.py),
and evaluation reads the validation split. The windows are the model's sequence length + 1 (the
example input's second dimension), in the global, seeded order of Note [global sample order], so a
resumed run on any layout continues on the uninterrupted run's samples. A model whose vocabulary is
smaller than the corpus's ids is refused here, before the trace: an id past the embedding would
fail on a rank mid-run, or worse, index another row on a device that does not check; and the
model's vocabulary rides in the batches' keywords (``vocab``), so the rank checks its ids against
it too (Note [ids inside the vocabulary] in runtime/data/corpus/formats.py).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from partitioner.frontend.workload import Workload
from runtime.data.corpus import CorpusError, CorpusSpec, open_source
from runtime.data.corpus.spec import absolute_spec
from runtime.data.corpus import batches

MAKE_BATCH = "runtime.data.corpus.batches:make_batch"
ROWS = "runtime.data.corpus.batches:rows"


def corpus_vocab(text: str) -> int:
    """The corpus's vocabulary size (ids are below it): what a built-in gpt without vocab= takes."""
    return open_source(CorpusSpec.parse(text)).vocab_size


def model_vocab(model: torch.nn.Module) -> int | None:
    """The model's input vocabulary: a Hugging Face config's ``vocab_size``, else the first
    embedding's rows; None when the model has no embedding (no token model)."""
    config = getattr(model, "config", None)
    if isinstance(getattr(config, "vocab_size", None), int):
        return config.vocab_size
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            return module.num_embeddings
    return None


def with_corpus(workload: Workload, text: str, *, seed: int = 0, global_batch: int = 1) -> Workload:
    """``workload`` trained on the corpus ``text`` (Note [a corpus replaces make_batch]); ValueError
    naming the value and the fix when the model cannot take its tokens."""
    args = workload.example_args
    if workload.example_kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor) \
            or args[0].dim() != 2 or args[0].dtype not in (torch.int64, torch.int32):
        raise ValueError(f"--data {text}: a corpus feeds causal-LM token windows, one [batch, seq] integer tensor; "
                         f"{workload.name!r} takes {_described(args, workload.example_kwargs)}: give it a make_batch "
                         "of its own instead of --data")
    if workload.loss_fn is None:
        raise ValueError(f"--data {text}: {workload.name!r} computes its own loss from its inputs; a corpus gives "
                         "(tokens, next tokens): give the workload a loss_fn(logits, targets)")
    try:
        text = absolute_spec(text)  # the ranks run from anywhere
        opened = open_source(CorpusSpec.parse(text))
    except CorpusError as exc:
        raise ValueError(f"--data {text}: {exc}") from None
    vocab = model_vocab(workload.model)
    if vocab is not None and vocab < opened.vocab_size:
        raise ValueError(f"--data {text}: the corpus's vocabulary is {opened.vocab_size} ids but {workload.name!r} "
                         f"embeds {vocab}: build the model with vocab >= {opened.vocab_size} (gpt:vocab="
                         f"{opened.vocab_size}), or prepare the corpus with the model's tokenizer")
    seq = int(args[0].shape[1])
    kwargs = {"source": text, "seq": seq, "seed": seed, **({"vocab": vocab} if vocab is not None else {})}
    try:
        batches.check_fits(opened, "train", seq=seq, global_batch=global_batch)
    except CorpusError as exc:
        raise ValueError(f"--data {text}: {exc}") from None
    source = {**workload.source, "make_batch": (MAKE_BATCH, kwargs), "rows": (ROWS, kwargs)}
    if "val" in opened.splits:
        source["eval_batch"] = (MAKE_BATCH, {**kwargs, "split": "val"})
    return dataclasses.replace(workload, make_batch=functools.partial(batches.make_batch, **kwargs),
                               source=source)


def _described(args, kwargs) -> str:
    parts = [f"{tuple(a.shape)} {a.dtype}" if isinstance(a, torch.Tensor) else type(a).__name__ for a in args]
    return f"inputs ({', '.join(parts)})" + (f" and keyword inputs {sorted(kwargs)}" if kwargs else "")
