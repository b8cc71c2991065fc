"""The program folder: stage files, buffers apart from parameters, meta-device materialization."""

from __future__ import annotations

import pytest
import torch

from _programs import compile_to
from partitioner.models.builtin import gpt, hf_llama
from runtime.program.spec import load_program
from runtime.execute.stage import build_stage


def test_meta_model_ranks_draw_the_same_weights_under_any_partition(tmp_path):
    """Note [materialize per rank] holds: values depend on the parameter's name, not on the plan."""
    def tiny():
        return gpt(layers=3, width=32, heads=2, vocab=64, seq=16, device="meta")

    compile_to(tmp_path / "one", tiny(), devices=1, num_stages=1, microbatches=4)
    compile_to(tmp_path / "three", tiny(), devices=3, num_stages=3, microbatches=4)
    assert not (tmp_path / "one" / "weights").exists()
    whole = dict(build_stage(str(tmp_path / "one"), 0).named_parameters())
    pieces = {}
    for k in range(3):
        pieces.update(dict(build_stage(str(tmp_path / "three"), k).named_parameters()))
    assert set(whole) == set(pieces) and len(whole) == 3 * 12 + 5
    for name, value in whole.items():
        assert torch.equal(value, pieces[name]), name
    # torch's defaults: LayerNorm weight ones, Linear weight within ±1/sqrt(fan_in)
    assert torch.equal(whole["ln_f.weight"], torch.ones(32))
    assert whole["blocks.0.mlp.fc.weight"].abs().max() <= 1 / 32**0.5
    assert float(whole["tok_emb.weight"].detach().std()) == pytest.approx(1.0, rel=0.1)


def test_stage_files_read_as_the_model_and_keep_buffers_apart(tmp_path):
    compile_to(tmp_path / "llama", hf_llama(layers=2, width=32, heads=2, vocab=64, seq=16), devices=2,
               num_stages=2, microbatches=4)
    text = (tmp_path / "llama" / "stage_0.py").read_text()
    assert "modeling_llama.py" in text  # comments point at the model's source lines
    assert '"model.rotary_emb.inv_freq"' in text.split("BUFFERS")[1].split("INPUTS")[0]
    stage = build_stage(str(tmp_path / "llama"), 0)
    trained = {n for n, _ in stage.named_parameters()}
    assert "model.rotary_emb.inv_freq" not in trained
    assert "model.rotary_emb.inv_freq" in {n for n, _ in stage.named_buffers()}
    program = load_program(str(tmp_path / "llama"))
    # rotary tables are the same for every sample: they cross whole, not split by batch
    crossing = program.stages[1].inputs
    assert any(v.batch_dim is None for v in crossing)
    assert all(v.shape[0] == 2 for v in crossing if v.batch_dim == 0)
