"""Hugging Face in and out: ``hf:CONFIG_DIR`` models, ``--pretrained`` safetensors read per rank,
and ``partitioner export`` back to ``from_pretrained`` (partitioner/models/hf.py, runtime/execute/pretrained.py,
partitioner/models/export.py). Tiny configs; every program trains under torchrun (the session's shared
launch, tests/_shared_launch.py) and is compared with the unpartitioned model trained in one process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from _programs import compile_to
from _shared_launch import Job, prepare
from partitioner.cli.commands import main as cli
from partitioner.models.export import export
from partitioner.models.builtin import load_workload
from partitioner.cli.verify import check_run, read_program_run
from runtime.execute import pretrained
from runtime.resilience.checkpoint import CheckpointCorruptError, list_step_dirs, shard_filename, step_dirname
from runtime.execute.stage import build_stage

STEPS = 2


def _configs(root: Path) -> dict[str, Path]:
    dirs = {}
    gpt2 = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                   bos_token_id=0, eos_token_id=0)  # dropout 0.1: keyed random ops
    bert = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                   intermediate_size=64, vocab_size=64, max_position_embeddings=16,
                                   pad_token_id=0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                   architectures=["BertForMaskedLM"])
    vit = transformers.ViTConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                 image_size=16, patch_size=8, num_labels=5, architectures=["ViTForImageClassification"])
    t5 = transformers.T5Config(num_layers=1, d_model=32, num_heads=2, d_kv=16, d_ff=64, vocab_size=64,
                               decoder_start_token_id=0, dropout_rate=0.0, architectures=["T5ForConditionalGeneration"])
    # config.json files as Hugging Face writes them: Falcon's attention lifts constants in the trace,
    # ResNet's config has no image_size
    falcon = transformers.FalconConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, vocab_size=64,
                                       new_decoder_architecture=False, architectures=["FalconForCausalLM"])
    resnet = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=5,
                                       architectures=["ResNetForImageClassification"])
    # BLOOM's MLP applies its own autograd Function, GeLUFunction (Note [autograd Functions run as
    # themselves]); with dropout, the oracle is the traced graph, which calls it too
    bloom = transformers.BloomConfig(n_layer=2, hidden_size=32, n_head=4, vocab_size=64, hidden_dropout=0.1,
                                     architectures=["BloomForCausalLM"])
    for name, config in (("gpt2", gpt2), ("bert", bert), ("vit", vit), ("t5", t5), ("falcon", falcon),
                         ("resnet", resnet), ("bloom", bloom)):
        config.save_pretrained(root / name)
        dirs[name] = root / name
    # Pretrained weights unlike our own initialisation (another seed, torch's global generator),
    # sharded so that a stage's tensors sit in several files.
    torch.manual_seed(123)
    trained = transformers.GPT2LMHeadModel(transformers.AutoConfig.from_pretrained(root / "gpt2"))
    trained.save_pretrained(root / "gpt2-pretrained", max_shard_size="20KB")
    dirs["gpt2-pretrained"] = root / "gpt2-pretrained"
    return dirs


@prepare
def _hf_programs(root: Path):
    dirs = _configs(root / "configs")
    out = {"dirs": dirs, "root": root}
    # the CLI's compile, as a user types it
    assert cli(["compile", f"hf:{dirs['gpt2']}", "-o", str(root / "gpt2"), "--devices", "2", "--stages", "2",
                "--microbatches", "2", "-q"]) == 0
    assert cli(["compile", f"hf:{dirs['gpt2']}", "--pretrained", str(dirs["gpt2-pretrained"]), "-o",
                str(root / "pretrained"), "--devices", "2", "--stages", "2", "--microbatches", "2", "-q"]) == 0
    for name, spec in (("meta", f"hf:{dirs['gpt2']},device=meta"), ("bert", f"hf:{dirs['bert']}"),
                       ("vit", f"hf:{dirs['vit']}"), ("t5", f"hf:{dirs['t5']},seq=8"),
                       ("falcon", f"hf:{dirs['falcon']},seq=8"), ("resnet", f"hf:{dirs['resnet']},image=16"),
                       ("bloom", f"hf:{dirs['bloom']},seq=8")):
        compile_to(root / name, load_workload(spec), devices=2, num_stages=2, microbatches=2,
                   training={"model_spec": spec})
    jobs = [Job(2, [root / n, "--steps", str(STEPS)])
            for n in ("gpt2", "pretrained", "meta", "bert", "vit", "t5", "falcon", "resnet", "bloom")]
    return out, jobs


@pytest.fixture(scope="module")
def hf(shared_launches):
    """Trained in the session's 2-worker shared launch (tests/_shared_launch.py)."""
    out, outputs = shared_launches.result(_hf_programs)
    return {**out, "stdout": "".join(o.stdout for o in outputs)}


def _verdict(folder: Path, workload=None):
    report = check_run(folder, folder / "run", steps=STEPS, workload=workload)
    assert report.ok, report.text()
    return report


def test_hf_config_dir_compiles_and_verifies(hf):
    """`partitioner compile hf:DIR` trains like the unpartitioned model: `partitioner verify`'s
    verdict (check_run) on the program's run in the shared launch (GPT-2 with its dropout, so the
    oracle is the traced graph with keyed random ops)."""
    report = _verdict(hf["root"] / "gpt2")
    assert report.oracle == "unpartitioned traced graph (keyed randomness)"
    program = json.loads((hf["root"] / "gpt2" / "plan.json").read_text())["program"]
    assert program["init"]["weights"][0] == "runtime.execute.pretrained:hf_weights"
    assert not (hf["root"] / "gpt2" / "weights").exists()  # the ranks made their own


@pytest.mark.parametrize("name,architecture", [("bert", "BertForMaskedLM"), ("vit", "ViTForImageClassification"),
                                               ("t5", "T5ForConditionalGeneration")])
def test_masked_lm_image_classification_and_seq2seq_verify(hf, name, architecture):
    _verdict(hf["root"] / name)
    program = json.loads((hf["root"] / name / "plan.json").read_text())["program"]
    assert program["init"]["weights"][1]["architecture"] == architecture


def test_falcon_and_resnet_from_plain_config_files_verify(hf):
    """Falcon's lifted constants travel in weights/ beside the ranks' own initialisation (Note
    [constants travel] in runtime/execute/stage.py); ResNet's config without image_size takes image=."""
    _verdict(hf["root"] / "falcon")
    _verdict(hf["root"] / "resnet")
    from safetensors.torch import load_file

    shipped = [name for path in sorted((hf["root"] / "falcon" / "weights").glob("*.safetensors"))
               for name in load_file(str(path))]
    assert shipped and all("lifted_tensor" in name for name in shipped)  # constants only: the ranks make the weights
    assert load_workload(f"hf:{hf['dirs']['resnet']}").example_args[0].shape[-1] == 224  # HF's crop by default


def test_bloom_from_a_plain_config_file_runs_its_gelu_function_as_itself_and_verifies(hf):
    """BLOOM's GeLUFunction (a tanh GeLU with a hand-written backward) is called by the stage files,
    imported from transformers, not traced through (Note [autograd Functions run as themselves])."""
    assert _verdict(hf["root"] / "bloom").oracle == "unpartitioned traced graph (keyed randomness)"
    stages = "".join((hf["root"] / "bloom" / f"stage_{k}.py").read_text() for k in (0, 1))
    assert stages.count("transformers.models.bloom.modeling_bloom.GeLUFunction.apply(") == 2, stages
    assert "\nimport transformers.models.bloom.modeling_bloom  #" in stages


def test_meta_built_ranks_start_from_the_oracles_weights(hf):
    """Note [own initialisation per rank] holds: each stage of a meta-built program materialises the very
    values the CPU-built model has, GPT-2's scaled residual projections included."""
    oracle = load_workload(f"hf:{hf['dirs']['gpt2']}")
    state = dict(oracle.model.named_parameters(remove_duplicate=False))
    folder = hf["root"] / "meta"
    for k in range(2):
        for name, p in build_stage(str(folder), k).named_parameters():
            assert torch.equal(p, state[name]), name
    n_layer = 2
    proj = state["transformer.h.0.attn.c_proj.weight"].detach()
    assert abs(float(proj.std()) - 0.02 / (2 * n_layer) ** 0.5) < 0.003  # not the 0.02 of a recipe
    _verdict(folder, workload=oracle)


def test_pretrained_weights_load_per_rank_and_match_from_pretrained(hf):
    folder, source = hf["root"] / "pretrained", hf["dirs"]["gpt2-pretrained"]
    program = json.loads((folder / "plan.json").read_text())["program"]
    in_files = set(json.loads((source / "model.safetensors.index.json").read_text())["weight_map"])
    opened_by_stage = []
    for k, stage in enumerate(program["stages"]):
        pretrained.OPENED.clear()
        module = build_stage(str(folder), k)
        opened = [n for names in pretrained.OPENED.values() for n in names]
        # the stage's own tensors, by their names in the files (lm_head.weight is stored as the
        # embedding it is tied to), each read once, nothing else
        want = {"transformer.wte.weight" if n == "lm_head.weight" else n for n in stage["params"]}
        assert sorted(opened) == sorted(want) and set(opened) <= in_files
        opened_by_stage.append(set(opened))
        expected = transformers.GPT2LMHeadModel.from_pretrained(source).state_dict()
        for name, p in module.named_parameters():
            assert torch.equal(p, expected[name]), name
    assert opened_by_stage[0] != opened_by_stage[1]
    assert len(opened_by_stage[0] | opened_by_stage[1]) == len(in_files)
    for rank, k in ((0, 0), (1, 1)):
        assert f"[rank {rank}] pretrained: read {len(opened_by_stage[k])} of the {len(in_files)} tensors" \
            in hf["stdout"]
    # the oracle is transformers' own from_pretrained, trained in one process
    report = _verdict(folder)
    assert abs(report.losses_program[0] - report.losses_oracle[0]) <= 1e-5


def test_export_loads_with_from_pretrained_with_equal_outputs(hf, tmp_path):
    folder = hf["root"] / "pretrained"
    assert cli(["export", str(folder), "-o", str(tmp_path / "out")]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    assert type(loaded).__name__ == "GPT2LMHeadModel"
    # the user's config as given (the trace's use_cache=False stays out), every tied name in the file
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["use_cache"] is json.loads((hf["dirs"]["gpt2"] / "config.json").read_text()).get("use_cache", True)
    from safetensors.torch import load_file

    fresh = transformers.GPT2LMHeadModel(transformers.AutoConfig.from_pretrained(tmp_path / "out"))
    fresh.load_state_dict(load_file(str(tmp_path / "out" / "model.safetensors")), strict=True)
    _, final, _ = read_program_run(folder / "run")  # the run's own final weights
    model = load_workload(f"hf:{hf['dirs']['gpt2']}").model
    with torch.no_grad():
        for name, value in final.items():
            dict(model.named_parameters(remove_duplicate=False))[name].copy_(value)
    start = transformers.GPT2LMHeadModel.from_pretrained(hf["dirs"]["gpt2-pretrained"]).state_dict()
    name = "transformer.h.0.mlp.c_fc.weight"
    assert not torch.equal(dict(model.named_parameters())[name], start[name])  # trained: not where it started
    tokens = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(5))
    model.eval(), loaded.eval()
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)


def test_export_refuses_corrupt_and_partial_checkpoints(hf, tmp_path):
    ckpt = tmp_path / "checkpoints"
    shutil.copytree(hf["root"] / "pretrained" / "checkpoints", ckpt)
    step = list_step_dirs(str(ckpt))[0]
    program = hf["root"] / "pretrained"
    shard = ckpt / step_dirname(step) / shard_filename(1)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match="sha256"):
        export(ckpt, tmp_path / "out", program_dir=program)
    (ckpt / step_dirname(step) / "manifest.json").unlink()
    with pytest.raises(ValueError, match="partial checkpoint"):
        export(ckpt / step_dirname(step), tmp_path / "out", program_dir=program)
    with pytest.raises(ValueError, match="no committed checkpoint"):
        export(ckpt, tmp_path / "out", program_dir=program)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]  # nothing half-written
