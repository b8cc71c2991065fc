"""A whole compile of a Llama-70B configuration on 64 H100s: trace, passes, every enumerated solve.

    .venv/bin/python benchmarks/compile_large.py [--devices 64] [--global-batch 512]

Target (issue: the partitioner): under 60 s on two CPU cores. The model lives on the meta device,
so nothing of its 70B parameters is materialized.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time

import transformers

import partitioner
from partitioner.config.cluster import ClusterSpec
from partitioner.frontend.workload import Workload
from runtime.data import synthetic as data
import torch


def llama70b(seq: int) -> Workload:
    config = transformers.LlamaConfig(
        num_hidden_layers=80, hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=seq, use_cache=False,
        attn_implementation="sdpa", bos_token_id=0, eos_token_id=0, pad_token_id=0)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    return Workload(model=model, example_args=(torch.zeros(1, seq, dtype=torch.long, device="meta"),),
                    loss_fn=data.causal_lm_loss, name="llama-70b")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=512)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--time-limit", type=float, default=10.0)
    args = parser.parse_args()
    started = time.perf_counter()
    workload = llama70b(args.seq)
    built = time.perf_counter()
    steps = []
    plan = partitioner.compile(workload, cluster=ClusterSpec.homogeneous(args.devices, "h100"),
                               global_batch=args.global_batch,
                               progress=lambda msg: steps.append((time.perf_counter(), msg)))
    done = time.perf_counter()
    params = sum(p.numel() for p in workload.model.parameters())
    print(f"llama-70b config: {params / 1e9:.1f} B parameters, {args.devices} x h100, global batch {args.global_batch}")
    last = built
    for t, msg in steps:
        print(f"  {t - started:7.2f} s  {msg}")
    print(plan.summary().splitlines()[1])
    print(f"predicted step {plan.predicted['step_time_s']:.3f} s; solver {plan.solver['status']} "
          f"gap {plan.solver['gap'] * 100:.2f}%")
    total = done - started
    rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"build {built - started:.1f} s, compile {done - built:.1f} s, total {total:.1f} s "
          f"(target < 60 s), peak RSS {rss_gib:.2f} GiB")
    return 0 if total < 60 else 1


if __name__ == "__main__":
    sys.exit(main())
