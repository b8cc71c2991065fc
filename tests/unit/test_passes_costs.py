"""Shapes, flops and memory passes against torch's own accounting on the real models.

Oracles: FlopCounterMode over a real forward + backward of ``out.sum()`` (the graph's total is the
sum over its nodes; ``sum`` costs 0 FLOPs), and ``saved_tensors_hooks`` over a real forward
(unique storages, parameters and buffers excluded). Tiny configs keep this file to seconds.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import passes
from passes import ir
from partitioner.models import builtin as models
from partitioner.frontend.trace import trace
from passes.memory import annotate_memory

TINY = dict(layers=2, width=32, heads=2, vocab=64, seq=16)

WORKLOADS = {
    "gpt": lambda: models.gpt(**TINY),
    "gpt-dropout": lambda: models.gpt(**TINY, dropout=0.1),
    "gpt2-eager": lambda: models.hf_gpt2(**TINY, attn="eager"),
    "gpt2-sdpa": lambda: models.hf_gpt2(**TINY, attn="sdpa"),
    "llama-eager": lambda: models.hf_llama(**TINY, attn="eager"),
    "llama-sdpa": lambda: models.hf_llama(**TINY, attn="sdpa"),
    "bert-eager": lambda: models.hf_bert(**TINY, attn="eager"),
    "bert-sdpa": lambda: models.hf_bert(**TINY, attn="sdpa"),
}


@functools.cache
def annotated(key: str):
    workload = WORKLOADS[key]()
    gm = trace(workload.model, workload.example_args).gm
    passes.run_all(gm, granularity="block")
    return workload, gm


def _logits(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.logits


def real_flops(model: nn.Module, args: tuple) -> int:
    # The math SDPA backend decomposes attention into matmuls FlopCounterMode counts (its CPU
    # flash kernel counts 0), so the oracle sees attention too.
    model.zero_grad(set_to_none=True)
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        _logits(model(*args)).float().sum().backward()
    return counter.get_total_flops()


def real_saved_bytes(model: nn.Module, args: tuple) -> int:
    state = {t.untyped_storage()._cdata for t in list(model.parameters()) + list(model.buffers())}
    kept: dict[int, tuple[int, torch.Tensor]] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage._cdata not in state:
            kept[storage._cdata] = (storage.nbytes(), t)  # holding t keeps the id unique
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*args)
    return sum(nbytes for nbytes, _ in kept.values())


def graph_flops(gm) -> int:
    return sum(ir.get(n, ir.FLOPS).fwd_flops + ir.get(n, ir.FLOPS).bwd_flops for n in gm.graph.nodes)


def total(gm, field: str) -> int:
    return sum(getattr(ir.get(n, ir.MEMORY), field) for n in gm.graph.nodes)


@pytest.mark.parametrize("key", ["gpt", "gpt2-eager", "llama-eager", "bert-eager", "gpt-dropout"])
def test_flops_add_up_to_flop_counter_on_the_real_model(key):
    workload, gm = annotated(key)
    assert graph_flops(gm) == real_flops(workload.model, workload.example_args)


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_sdpa_model_totals_the_flops_of_its_eager_twin(family):
    _, sdpa = annotated(f"{family}-sdpa")
    _, eager = annotated(f"{family}-eager")
    assert graph_flops(sdpa) == graph_flops(eager) > 0
    assert any(passes_sdpa(n) for n in sdpa.graph.nodes)


def passes_sdpa(node) -> bool:
    from passes.flops import is_sdpa

    return is_sdpa(node) and ir.get(node, ir.FLOPS).fwd_flops > 0


def test_grouped_query_attention_sdpa_matches_eager():
    import transformers

    totals = {}
    for attn in ("sdpa", "eager"):
        config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=4,
                                          num_key_value_heads=1, intermediate_size=64, vocab_size=64,
                                          max_position_embeddings=16, use_cache=False, attn_implementation=attn)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
        tokens = torch.zeros(2, 16, dtype=torch.long)
        gm = trace(model, (tokens,)).gm
        passes.run_all(gm)
        totals[attn] = graph_flops(gm)
        if attn == "eager":
            assert totals[attn] == real_flops(model, (tokens,))
    assert totals["sdpa"] == totals["eager"]


def test_backward_skips_gradients_of_inputs_that_do_not_require_grad():
    workload = models.mlp(features=8, hidden=16, depth=2, outputs=4, batch=3)
    gm = trace(workload.model, workload.example_args).gm
    passes.run_all(gm)
    linears = [n for n in gm.graph.nodes if n.op == "call_function" and "linear" in str(n.target)]
    first, second = (ir.get(n, ir.FLOPS) for n in linears[:2])
    assert first.fwd_flops == 2 * 3 * 8 * 16
    assert first.bwd_flops == first.fwd_flops  # weight grad only: the data input needs none
    assert second.bwd_flops == 2 * second.fwd_flops  # weight grad + input grad
    assert graph_flops(gm) == real_flops(workload.model, workload.example_args)


@pytest.mark.parametrize("key", list(WORKLOADS))
def test_saved_activations_within_10_percent_of_autograd(key):
    workload, gm = annotated(key)
    torch.manual_seed(0)
    real = real_saved_bytes(workload.model, workload.example_args)
    ours = total(gm, "saved_activation_bytes")
    assert real > 0 and abs(ours - real) <= 0.10 * real, (ours, real)


def test_output_saved_by_several_consumers_counts_once():
    class Fan(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c, self.d = (nn.Linear(8, 8) for _ in range(4))

        def forward(self, x):
            h = torch.tanh(self.a(x))  # tanh saves its output; three linears save it again
            return self.b(h) + self.c(h) + self.d(h)

    model = Fan()
    x = torch.zeros(4, 8)
    gm = trace(model, (x,)).gm
    passes.run_all(gm)
    tanh = next(n for n in gm.graph.nodes if "tanh" in str(n.target))
    assert ir.get(tanh, ir.MEMORY).saved_activation_bytes == 4 * 8 * 4
    assert total(gm, "saved_activation_bytes") == real_saved_bytes(model, (x,))


@pytest.mark.parametrize("key", ["gpt", "gpt2-sdpa", "llama-sdpa", "bert-sdpa"])
def test_parameter_bytes_count_each_parameter_once(key):
    workload, gm = annotated(key)
    params = {id(p): p for p in workload.model.parameters()}  # parameters() dedups tied weights
    used_buffers = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    param_bytes = sum(p.numel() * p.element_size() for p in params.values())
    buffer_bytes = sum(b.numel() * b.element_size() for name, b in workload.model.named_buffers()
                       if name in used_buffers)
    assert total(gm, "param_bytes") == param_bytes + buffer_bytes
    assert total(gm, "grad_bytes") == param_bytes  # buffers get no gradient
    assert total(gm, "optimizer_bytes") == 2 * param_bytes  # AdamW: exp_avg + exp_avg_sq


def test_tied_embedding_is_one_get_attr_counted_once():
    workload, gm = annotated("gpt2-sdpa")
    model = workload.model
    assert model.lm_head.weight is model.transformer.wte.weight
    tied = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target in ("lm_head.weight", "transformer.wte.weight")]
    assert len(tied) == 1 and len(tied[0].users) == 2
    nbytes = model.lm_head.weight.numel() * 4
    assert ir.get(tied[0], ir.MEMORY).param_bytes == nbytes


@pytest.mark.parametrize("optimizer,factor", [("adamw", 2), ("adam", 2), ("sgd_momentum", 1), ("sgd", 0)])
def test_optimizer_state_factor(optimizer, factor):
    _, gm = annotated("gpt")
    annotate_memory(gm, optimizer=optimizer)
    assert total(gm, "optimizer_bytes") == factor * total(gm, "grad_bytes")
    annotate_memory(gm)


def test_unknown_optimizer_is_refused():
    _, gm = annotated("gpt")
    with pytest.raises(ValueError, match="unknown optimizer 'lamb'"):
        annotate_memory(gm, optimizer="lamb")


def test_frozen_parameters_get_no_grad_or_optimizer_state():
    workload = models.mlp(features=8, hidden=16, depth=2, outputs=4)
    workload.model.layers[0].requires_grad_(False)
    gm = trace(workload.model, workload.example_args).gm
    passes.run_all(gm)
    frozen = sum(p.numel() * 4 for p in workload.model.layers[0].parameters())
    assert total(gm, "param_bytes") - total(gm, "grad_bytes") == frozen
    first = next(n for n in gm.graph.nodes if n.op == "call_function" and "linear" in str(n.target))
    assert ir.get(first, ir.FLOPS).bwd_flops == 0  # nothing before it needs a gradient


def test_shapes_cover_every_node_kind():
    workload, gm = annotated("gpt")
    for node in gm.graph.nodes:
        meta = ir.get(node, ir.SHAPE)
        if node.op == "get_attr":
            param = workload.model.get_parameter(node.target)
            assert meta.shapes == (tuple(param.shape),) and meta.output_bytes == param.numel() * 4
        if node.op == "output":
            assert meta.shapes == () and meta.output_bytes == 0
        if node.op == "call_function" and "split" in str(node.target):
            assert meta.shapes == ((2, 16, 2, 16),) * 3 and meta.output_bytes == 3 * 2 * 16 * 32 * 4  # per head: q, k, v
    placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder")
    assert ir.get(placeholder, ir.SHAPE) == ir.ShapeMeta(((2, 16),), ("int64",), 2 * 16 * 8)


def test_every_pass_writes_every_node():
    _, gm = annotated("llama-sdpa")
    for node in gm.graph.nodes:
        for key in (ir.SHAPE, ir.FLOPS, ir.MEMORY, ir.REGION):
            assert ir.has(node, key), (node.name, key)
    assert passes.annotate_flops.spec.writes == (ir.FLOPS,)


def test_passes_run_on_a_meta_device_model():
    workload = models.gpt(**TINY, device="meta")
    assert next(workload.model.parameters()).device.type == "meta"
    gm = trace(workload.model, workload.example_args).gm
    passes.run_all(gm, granularity="sublayer")
    _, cpu_gm = annotated("gpt")
    assert graph_flops(gm) == graph_flops(cpu_gm)
    assert total(gm, "saved_activation_bytes") == total(cpu_gm, "saved_activation_bytes")
    assert total(gm, "param_bytes") == total(cpu_gm, "param_bytes")


def test_sdpa_formula_counts_causal_attention_full():
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(16, 48)

        def forward(self, x):
            q, k, v = self.qkv(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    gm = trace(Attn(), (torch.zeros(2, 8, 16),)).gm
    passes.run_all(gm)
    sdpa = next(n for n in gm.graph.nodes if "scaled_dot_product" in str(n.target))
    b, h, s, d = 2, 2, 8, 8
    assert ir.get(sdpa, ir.FLOPS) == ir.FlopsMeta(fwd_flops=2 * 2 * b * h * s * s * d, bwd_flops=4 * 2 * b * h * s * s * d)
