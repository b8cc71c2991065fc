"""The attention core (Note [the attention core] in passes/attention_core.py): tagged on the built-in
gpt (eager and SDPA) and nanoGPT as the compiler's keyed graph, and Hugging Face GPT-2 and Llama
built from a config as traced (aten dropout); nothing else tagged."""

from __future__ import annotations

import pytest
import torch

import passes
from passes.attention_core import attention_cores
from partitioner.frontend.randomness import lower_randomness
from partitioner.frontend.trace import trace
from partitioner.models import builtin as models
from tests import _zoo

EAGER_CORE = ["matmul", "softmax", "dropout", "matmul"]  # in order, with the scale, mask and casts between


def _cores(workload=None, *, model=None, args=None, keyed=False):
    model, args = (workload.model, workload.example_args) if workload is not None else (model, args)
    gm = trace(model, args).gm
    if keyed:  # the compiler's graph: dropout lowered to runtime.execute.randomness's keyed draw
        lower_randomness(gm, batch_size=2)
    passes.run_all(gm)
    return gm, attention_cores(gm)


def _kinds(core) -> list[str]:
    names = [n.name.rstrip("_0123456789") for n in core]
    return [k for k in names if k in ("matmul", "softmax", "dropout")]


def test_builtin_gpt_eager_one_core_per_layer_from_scores_to_the_product_with_v():
    gm, cores = _cores(models.gpt(layers=3, width=16, heads=2, vocab=32, seq=8, attn="eager", dropout=0.1),
                       keyed=True)
    assert len(cores) == 3 and all(_kinds(c) == EAGER_CORE for c in cores)
    order = list(gm.graph.nodes)
    for core in cores:  # one contiguous run of the graph, the causal mask made inside it
        start = order.index(core[0])
        assert order[start:start + len(core)] == core
        assert any(n.name.startswith("triu") for n in core)
    # the block's projections, norms, MLP and residual dropout stay outside
    tagged = {n for c in cores for n in c}
    assert not any(n.name.startswith(("linear", "layer_norm", "gelu")) for n in tagged)


def test_an_sdpa_call_is_one_core():  # with dropout: the keyed attention the compiler lowers it to
    _, cores = _cores(models.gpt(layers=2, width=16, heads=2, vocab=32, seq=8, dropout=0.1), keyed=True)
    assert len(cores) == 2 and all(len(c) == 1 for c in cores), cores


def test_nanogpt_and_its_sdpa_with_dropout():
    torch.manual_seed(0)
    _, cores = _cores(model=_zoo.GPT().train(), args=_zoo.gpt_batch(0, 2)[0], keyed=True)
    assert len(cores) == 2 and all(len(c) == 1 for c in cores)


@pytest.mark.parametrize("build", [models.hf_gpt2, models.hf_llama], ids=["gpt2", "llama"])
def test_hugging_face_eager_attention_with_its_casts_and_dropout(build):
    _, cores = _cores(build(layers=2, width=32, heads=2, vocab=64, seq=16, attn="eager", dropout=0.1))
    assert len(cores) == 2 and all(_kinds(c) == EAGER_CORE for c in cores)


class _SoftmaxHead(torch.nn.Module):
    """A softmax between two matmuls that is no attention: the product's other operand escapes
    in between (a second user of the scores)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        scores = x @ self.w
        probs = scores.softmax(-1)
        return probs @ self.w + scores.sum()


def test_nothing_else_is_tagged():
    _, cores = _cores(models.mlp(features=8, hidden=16, depth=3, outputs=4))
    assert cores == []
    _, cores = _cores(model=_SoftmaxHead(), args=(torch.randn(2, 8),))
    assert cores == []  # the scores are read after the softmax: not a unit the core's recompute can drop
