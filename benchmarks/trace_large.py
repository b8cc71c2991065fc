"""Trace and annotate (shapes, flops, memory, regions) a 7B-parameter Llama on the meta device.

    .venv/bin/python benchmarks/trace_large.py [--granularity block|sublayer|node]

Prints the time of each step and the peak RSS; exits 1 if the whole (model build + trace + the
four passes) takes over 60 s or the process peaks over 4 GiB. Nothing is materialized: the model
is built on the meta device and the passes run on fake tensors.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time

import torch

TIME_LIMIT_S = 60.0
RSS_LIMIT_BYTES = 4 * 2**30


def peak_rss_bytes() -> int:
    # ru_maxrss is in KiB on Linux (bytes on macOS).
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def llama_7b(seq: int, batch: int):
    """The Llama-2-7B shape: 32 layers, width 4096, 32 heads, MLP 11008, vocab 32000."""
    import transformers

    config = transformers.LlamaConfig(
        num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=32,
        intermediate_size=11008, vocab_size=32000, max_position_embeddings=seq,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, use_cache=False, attn_implementation="sdpa")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    model.train()
    return model, (torch.zeros(batch, seq, dtype=torch.long, device="meta"),)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--granularity", default="block", choices=["block", "sublayer", "node"])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args(argv)

    import passes
    from passes import ir
    from partitioner.frontend.trace import trace

    steps: list[tuple[str, float]] = []
    start = last = time.perf_counter()

    def step(name: str) -> None:
        nonlocal last
        now = time.perf_counter()
        steps.append((name, now - last))
        last = now

    model, example_args = llama_7b(args.seq, args.batch)
    num_params = sum(p.numel() for p in model.parameters())
    step("build (meta)")
    gm = trace(model, example_args).gm
    step("trace")
    passes.annotate_shapes(gm)
    step("shapes")
    passes.annotate_flops(gm)
    step("flops")
    passes.annotate_memory(gm, optimizer="adamw")
    step("memory")
    passes.annotate_regions(gm, granularity=args.granularity)
    step("regions")
    table = passes.region_table(gm)
    step("region_table")
    total_s = time.perf_counter() - start
    rss = peak_rss_bytes()

    nodes = list(gm.graph.nodes)
    fwd = sum(ir.get(n, ir.FLOPS).fwd_flops for n in nodes)
    bwd = sum(ir.get(n, ir.FLOPS).bwd_flops for n in nodes)
    params = sum(ir.get(n, ir.MEMORY).param_bytes for n in nodes)
    saved = sum(ir.get(n, ir.MEMORY).saved_activation_bytes for n in nodes)
    print(f"llama-7b: {num_params / 1e9:.2f} B parameters, seq={args.seq}, batch={args.batch}, "
          f"{len(nodes)} nodes, {len(table)} regions ({args.granularity})")
    for name, seconds in steps:
        print(f"  {name:<14} {seconds:7.2f} s")
    print(f"  fwd {fwd / 1e12:.1f} TFLOP, bwd {bwd / 1e12:.1f} TFLOP, params {params / 2**30:.2f} GiB, "
          f"saved activations {saved / 2**30:.2f} GiB")
    print(f"total {total_s:.1f} s (limit {TIME_LIMIT_S:.0f} s), peak RSS {rss / 2**20:.0f} MiB "
          f"(limit {RSS_LIMIT_BYTES / 2**20:.0f} MiB)")
    ok = total_s <= TIME_LIMIT_S and rss <= RSS_LIMIT_BYTES
    if not ok:
        print("FAIL: over the time or memory limit", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
