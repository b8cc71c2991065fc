"""The built-in gpt exported as transformers' GPT2LMHeadModel (Note [the built-in gpt is GPT-2] in
partitioner/models/gpt_as_gpt2.py): save_pretrained, from_pretrained, the same logits. (`partitioner
export` of a trained gpt program end to end: tests/e2e/test_generate.py.)"""

from __future__ import annotations

import pytest
import torch

from partitioner.models import gpt_as_gpt2
from partitioner.models.builtin import load_workload

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("spec", ["gpt:layers=2,width=32,heads=4,vocab=64,seq=16",
                                  "gpt:layers=1,width=24,heads=3,vocab=50,seq=8,dropout=0.1,attn=eager"])
def test_the_export_loads_with_from_pretrained_and_gives_the_same_logits(spec, tmp_path):
    workload = load_workload(spec)
    model = workload.model.eval()
    with torch.no_grad():  # not the initial values: every tensor distinct, biases and LayerNorms too
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.2)
    args = gpt_as_gpt2.gpt_args(workload.name)
    state = dict(model.state_dict())
    assert gpt_as_gpt2.mismatch(state, args) is None
    gpt_as_gpt2.gpt2_model(state, args).save_pretrained(str(tmp_path))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert type(loaded).__name__ == "GPT2LMHeadModel"
    assert loaded.config.n_head == args["heads"] and loaded.config.attn_pdrop == args["dropout"]
    tokens = torch.randint(0, args["vocab"], (3, args["seq"]), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, model(tokens))


def test_only_the_built_in_gpt_is_converted():
    assert gpt_as_gpt2.gpt_args("mlp(features=8,hidden=32,depth=2,outputs=4)") is None
    assert gpt_as_gpt2.gpt_args("hf-gpt2(layers=2,width=64,heads=4,vocab=256,seq=32,attn=sdpa)") is None
    assert gpt_as_gpt2.gpt_args(None) is None
    args = gpt_as_gpt2.gpt_args("gpt(layers=1,width=8,heads=2,vocab=16,seq=4,dropout=0.0)")
    state = {n: torch.zeros(s) for n, s in gpt_as_gpt2._gpt_shapes(**args).items()}
    assert gpt_as_gpt2.mismatch(state, args) is None
    # a model of one's own that happens to be named gpt(...): its tensors say it is not
    assert "not the built-in gpt's" in gpt_as_gpt2.mismatch({**state, "extra.weight": torch.zeros(1)}, args)
    state["head.weight"] = torch.zeros(17, 8)
    assert gpt_as_gpt2.mismatch(state, args) == "head.weight is [17, 8], the built-in gpt's is [16, 8]"


def test_a_built_in_hf_model_without_its_config_says_how_to_get_one():
    """Issue 43: a built-in hf-llama compiled on cpu exported with no config.json and a line calling it
    neither a Hugging Face model nor the built-in gpt; its name cannot rebuild the config exactly."""
    from partitioner.models.export import _as_gpt2

    args, why = _as_gpt2({}, "hf-llama(layers=2,width=64,heads=4,vocab=256,seq=32,attn=sdpa)")
    assert args is None and "neither" not in why
    assert "holds no Hugging Face config" in why and "hf-llama:...,device=meta" in why
    _, why = _as_gpt2({}, "mlp(features=8,hidden=32,depth=2,outputs=4)")
    assert "neither a Hugging Face model nor the built-in gpt" in why
