"""What reading batches from an on-disk corpus costs next to a training step (runtime/data/corpus/).

    .venv/bin/python benchmarks/data_loading.py [--steps 200] [--corpus-mb 4]

Prepares a byte-level corpus from this Python's own standard library sources (``partitioner data
prepare``'s ``prepare``), then at a small-GPT step (global batch 32, seq 256) prints:
  - data seconds per step: the median over ``--steps`` steps of ``make_batch`` (the whole global
    batch) and of ``rows`` for one replica's inputs at dp=2;
  - a measured training step on this machine: forward + backward + AdamW of a 4-layer GPT-like
    model (token embedding, 4 ``torch.nn.TransformerEncoderLayer`` with a causal mask, width 128,
    4 heads, an output projection over the 257 ids: bytes and EOD), same batch, median of a few steps;
  - their ratio (target: data < 1% of the step);
  - the bytes each rank of a 2-replica, 3-stage layout reads per step: stage 0 (its replica's
    inputs), a middle stage (nothing), the last stage (its replica's targets).
The corpus sits in the page cache after prepare, as a corpus read every epoch does: these are
warm reads; a cold first epoch adds the disk's time for the same (counted) bytes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

from runtime.data.corpus.prepare import prepare
from runtime.data.corpus.batches import make_batch, rows, source_for

GLOBAL_BATCH, SEQ, DP, STAGES = 32, 256, 2, 3
WIDTH, LAYERS, HEADS = 128, 4, 4


def stdlib_files(limit_bytes: int) -> list[str]:
    """This Python's standard library .py files, in name order, up to ``limit_bytes`` in all."""
    picked, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "site-packages" in path.parts or not path.is_file():
            continue
        picked.append(str(path))
        total += path.stat().st_size
        if total >= limit_bytes:
            break
    return picked


class SmallGPT(torch.nn.Module):
    def __init__(self, vocab: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, WIDTH)
        self.position = torch.nn.Parameter(torch.zeros(SEQ, WIDTH))
        layer = torch.nn.TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, dropout=0.0, batch_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = torch.nn.Linear(WIDTH, vocab)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(SEQ))

    def forward(self, tokens):
        return self.head(self.blocks(self.embed(tokens) + self.position, mask=self.mask, is_causal=True))


def median_s(fn, repeats: int, warmup: int = 2) -> float:
    times = []
    for i in range(warmup + repeats):
        start = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - start)
    return statistics.median(times[warmup:])


def train_step_s(source: str, vocab: int, repeats: int) -> float:
    torch.manual_seed(0)
    model = SmallGPT(vocab)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(i):
        (tokens,), targets = make_batch(i, GLOBAL_BATCH, source=source, seq=SEQ)
        loss = torch.nn.functional.cross_entropy(model(tokens).reshape(-1, vocab), targets.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return median_s(step, repeats, warmup=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--corpus-mb", type=float, default=4.0)
    parser.add_argument("--train-steps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    with tempfile.TemporaryDirectory() as tmp:
        files = stdlib_files(int(args.corpus_mb * 1e6))
        start = time.perf_counter()
        meta = prepare(files, os.path.join(tmp, "corpus"), tokenizer="bytes", append_eod=True)
        prepare_s = time.perf_counter() - start
        train = meta["splits"]["train"]
        print(f"corpus: {len(files)} stdlib files, {train['num_tokens']:,} train tokens "
              f"({meta['splits']['val']['num_tokens']:,} val), vocab {meta['vocab_size']}, prepared in {prepare_s:.2f} s")
        source = f"tokens:{tmp}/corpus"
        opened = source_for(source)
        share = GLOBAL_BATCH // DP
        batch_s = median_s(lambda i: make_batch(i, GLOBAL_BATCH, source=source, seq=SEQ), args.steps)
        replica_s = median_s(lambda i: rows(i, GLOBAL_BATCH, source=source, seq=SEQ, rows=range(share),
                                            want="inputs"), args.steps)
        step_s = train_step_s(source, meta["vocab_size"], args.train_steps)
        print(f"step: global batch {GLOBAL_BATCH}, seq {SEQ}; model: {LAYERS}-layer GPT-like, width {WIDTH}, "
              f"{HEADS} heads, vocab {meta['vocab_size']}, fp32, {torch.get_num_threads()} threads")
        print(f"  training step (forward + backward + AdamW), median of {args.train_steps}: {step_s * 1e3:9.2f} ms")
        print(f"  make_batch, whole global batch, median of {args.steps}:          {batch_s * 1e3:9.3f} ms "
              f"= {100 * batch_s / step_s:.3f}% of the step")
        print(f"  rows(), one dp={DP} replica's inputs, median of {args.steps}:      {replica_s * 1e3:9.3f} ms "
              f"= {100 * replica_s / step_s:.3f}% of the step")
        print(f"  target: data < 1% of the step: {'met' if max(batch_s, replica_s) < 0.01 * step_s else 'NOT met'}")
        print(f"bytes read per rank per step, {DP} replicas x {STAGES} stages (uint16 tokens):")
        for replica in range(DP):
            mine = range(replica * share, (replica + 1) * share)
            for stage in range(STAGES):
                want = "inputs" if stage == 0 else "targets" if stage == STAGES - 1 else None
                opened.stats.reset()
                for step in range(10):
                    rows(step, GLOBAL_BATCH, source=source, seq=SEQ, rows=mine, want=want)
                role = {0: "stage 0 (inputs)", STAGES - 1: "last stage (targets)"}.get(stage, "middle stage")
                print(f"  replica {replica} {role:22s} {opened.stats.bytes_read // 10:>8,} bytes"
                      f" ({opened.stats.windows_read // 10} windows)")
        print(f"  whole global batch (make_batch): {GLOBAL_BATCH * (SEQ + 1) * 2:,} bytes")


if __name__ == "__main__":
    main()
