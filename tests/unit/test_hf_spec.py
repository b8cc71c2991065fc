"""`hf:` specs (partitioner/models/hf.py) and the own initialisation per rank (runtime/execute/pretrained.py),
single process: tiny configs, a large one that stays on meta, a name in the local cache, errors."""

from __future__ import annotations

import huggingface_hub.constants
import pytest
import torch
import transformers

from partitioner.models.builtin import load_workload
from runtime.execute import pretrained


def _gpt2(folder, **extra):
    transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0,
                            eos_token_id=0, **extra).save_pretrained(folder)
    return folder


def _names(model):
    return list(pretrained.aliases(model))


@pytest.mark.parametrize("architecture,config", [
    ("GPT2LMHeadModel", transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)),
    ("LlamaForCausalLM", transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                                  num_key_value_heads=2, intermediate_size=64, vocab_size=64,
                                                  max_position_embeddings=16)),
    ("ViTForImageClassification", transformers.ViTConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                                         intermediate_size=64, image_size=16, patch_size=8)),
    ("T5ForConditionalGeneration", transformers.T5Config(num_layers=1, d_model=32, num_heads=2, d_kv=16, d_ff=64,
                                                         vocab_size=64, decoder_start_token_id=0)),
])
def test_own_initialisation_is_the_same_for_any_subset_of_tensors(architecture, config):
    """Note [own initialisation per rank] holds: a rank holding half the model gets the values a process
    holding all of it gets; buffers (rotary tables) equal what the constructor computes."""
    config = config.to_dict()
    model = pretrained.build_meta(config, architecture)
    names = _names(model)
    whole = pretrained.initial_weights(model, names, seed=3)
    for part in (names[::2], names[1::2], names[-3:]):
        some = pretrained.initial_weights(pretrained.build_meta(config, architecture), part, seed=3)
        for name in part:
            assert torch.equal(some[name], whole[name]), name
    other_seed = pretrained.initial_weights(pretrained.build_meta(config, architecture), names, seed=4)
    assert any(not torch.equal(other_seed[n], whole[n]) for n in names)
    built = getattr(transformers, architecture)(transformers.CONFIG_MAPPING[config["model_type"]].from_dict(config))
    for name, buffer in built.named_buffers():
        assert torch.equal(whole[name].to(buffer.dtype), buffer), name


def test_a_config_dir_builds_each_task(tmp_path):
    w = load_workload(f"hf:{_gpt2(tmp_path / 'g')},seq=8,batch=3")
    assert type(w.model).__name__ == "GPT2LMHeadModel" and w.example_args[0].shape == (3, 8)
    assert next(w.model.parameters()).device.type == "cpu"
    assert w.source["init"][0] == "runtime.execute.pretrained:hf_weights"
    (args, target) = w.make_batch(0, 3)
    with torch.no_grad():
        assert float(w.loss_fn(w.model(*args), target)) > 0
    transformers.BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                            vocab_size=64, max_position_embeddings=16).save_pretrained(tmp_path / "b")
    w = load_workload(f"hf:{tmp_path / 'b'},task=masked-lm")
    args, labels = w.make_batch(0, 2)
    assert type(w.model).__name__ == "BertForMaskedLM" and (labels != -100).any() and (labels == -100).any()
    with torch.no_grad():
        assert float(w.loss_fn(w.model(*args), labels)) > 0


def test_a_large_config_stays_on_meta(tmp_path):
    from partitioner.models import hf, builtin as models

    assert hf.META_THRESHOLD_BYTES == models.META_THRESHOLD_BYTES
    transformers.LlamaConfig(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=32,
                             intermediate_size=11008, vocab_size=32000,
                             max_position_embeddings=2048).save_pretrained(tmp_path)
    w = load_workload(f"hf:{tmp_path},seq=128")
    assert {p.device.type for p in w.model.parameters()} == {"meta"}
    assert sum(p.numel() for p in w.model.parameters()) > 6e9
    assert w.example_args[0].device.type == "meta"


def test_a_name_is_found_in_the_local_cache_only(tmp_path, monkeypatch):
    repo = tmp_path / "models--acme--tiny-gpt2"
    _gpt2(repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    assert type(load_workload("hf:acme/tiny-gpt2").model).__name__ == "GPT2LMHeadModel"
    with pytest.raises(ValueError, match=r"no local copy of 'acme/other'.*nothing is downloaded.*hf:DIR"):
        load_workload("hf:acme/other")


def test_errors_name_the_value_and_the_fix(tmp_path):
    folder = _gpt2(tmp_path / "g")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no readable config.json"):
        load_workload(f"hf:{tmp_path / 'empty'}")
    with pytest.raises(ValueError, match="'layers=3' is not one of task="):
        load_workload(f"hf:{folder},layers=3")
    with pytest.raises(ValueError, match="seq=x is not a whole number"):
        load_workload(f"hf:{folder},seq=x")
    with pytest.raises(ValueError, match="task=speech is not one of"):
        load_workload(f"hf:{folder},task=speech")
    with pytest.raises(ValueError, match="no masked-lm model for model_type 'gpt2'"):
        load_workload(f"hf:{folder},task=masked-lm")
    with pytest.raises(ValueError, match="longer than the model's 16 positions"):
        load_workload(f"hf:{folder},seq=64")
    with pytest.raises(ValueError, match="no model.safetensors or model.safetensors.index.json"):
        load_workload(f"hf:{folder}", pretrained=str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="reads Hugging Face safetensors into an hf: model"):
        load_workload("gpt", pretrained=str(folder))


def test_pretrained_of_another_configuration_is_refused(tmp_path):
    small = _gpt2(tmp_path / "small")
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64,
                                                         n_positions=16)).save_pretrained(tmp_path / "other")
    model = pretrained.build_meta(transformers.AutoConfig.from_pretrained(small).to_dict(), "GPT2LMHeadModel")
    with pytest.raises(ValueError, match=r"transformer.wte.weight is \(64, 16\).*another configuration"):
        pretrained.pretrained_weights(model, ["lm_head.weight"], str(tmp_path / "other"), 0)
    with pytest.raises(ValueError, match=r"is \(64, 16\).*another configuration"):  # at compile time
        load_workload(f"hf:{small}", pretrained=str(tmp_path / "other"))
