"""Programs compiled for a GPU kind make every tensor on the device their stage runs on (Note
[tensors a stage makes] in partitioner/codegen/split.py), and every model the suite builds from
Hugging Face compiles for one at its default precision (bf16-mixed: Note [boundaries in the
autocast dtype] in partitioner/codegen/boundary_dtypes.py).

No GPU is needed to see a CPU tensor meet a CUDA one: each stage of a ``--device h100`` compile is
built on ``meta`` and run, forward and backward, under ``_OffDevice``, which records the way CUDA
would fail. A tensor the code makes on the CPU then sits beside meta tensors (CUDA's "Expected all
tensors to be on the same device"), and a factory that makes a CPU tensor is named even before one
meets it. CPU scalars (0-dim) mix with CUDA tensors in torch, as they do here. One compile per
model, tiny configs.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

import partitioner
from _bn_workload import workload as bn_cnn
from partitioner.config.cluster import ClusterSpec
from partitioner.frontend.workload import Workload
from partitioner.models.builtin import gpt, hf_bert, hf_gpt2, hf_llama, hf_qwen2_moe, load_workload
from runtime.data import synthetic as data
from runtime.execute import randomness
from runtime.execute.stage import build_stage, example_args
from runtime.program.spec import load_program

transformers = pytest.importorskip("transformers")


class _OffDevice(TorchDispatchMode):
    """Records every op that mixes devices (a 0-dim CPU tensor aside), moves a tensor to another
    device (then runs it where its tensors are), or makes a tensor of one dimension or more on the
    CPU from no tensor."""

    def __init__(self):
        super().__init__()
        self.hits: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        devices = {t.device.type for t in tensors if not (t.device.type == "cpu" and t.dim() == 0)}
        named = {v.type for v in tree_flatten((args, kwargs))[0] if isinstance(v, torch.device)}
        if devices and named - devices:  # hf-llama's rotary table sent to the trace's cpu, each forward
            self.hits.append(f"a move to {sorted(named - devices)} in {func}")
            here = torch.device(next(iter(devices)))
            args, kwargs = tree_map(lambda v: here if isinstance(v, torch.device) else v, (args, kwargs))
        if func is torch.ops.partitioner_keyed.fill.default:
            # the keyed draw's shape and device, without drawing (no generator lives on meta)
            shape, _op, _batch_dim, _normal, device = args
            out = torch.empty(shape, device=device or torch.get_default_device())
        else:
            out = func(*args, **kwargs)
        made = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if len(devices) > 1:
            self.hits.append(f"mixed devices {sorted(devices)} in {func}")
        elif not tensors and any(t.device.type == "cpu" and t.dim() > 0 for t in made):
            self.hits.append(f"a tensor made on the cpu by {func}")
        return out


def off_device_ops(folder) -> list[str]:
    """Every stage of ``folder`` on meta, one forward and backward under ``_OffDevice``: its hits."""
    program = load_program(str(folder))
    hits = []
    for k in range(program.num_stages):
        module = build_stage(str(folder), k, "meta")
        inputs = example_args(program.stages[k].inputs, requires_grad=k > 0)
        mode = _OffDevice()
        try:
            with randomness.restored(randomness.Context(seed=0, step=0, first_sample=0, microbatch=0)), mode:
                outputs = [t for t in tree_flatten(module(*inputs))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
                torch.autograd.backward([t.sum() for t in outputs])
        except RuntimeError as error:  # after a hit: autograd expected the moved tensor where it was sent
            mode.hits.append(f"{type(error).__name__}: {str(error).splitlines()[0]}")
        hits += [f"stage {k}: {hit}" for hit in dict.fromkeys(mode.hits)]
    return hits


def _hf_config(root, name: str):
    """A Hugging Face config folder for ``hf:DIR``, as the suite's tests write them
    (tests/e2e/test_hf_in_out.py) plus a Mixtral, whose router casts an activation."""
    configs = {
        "vit": lambda: transformers.ViTConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                              intermediate_size=64, image_size=16, patch_size=8, num_labels=5,
                                              architectures=["ViTForImageClassification"]),
        "t5": lambda: transformers.T5Config(num_layers=1, d_model=32, num_heads=2, d_kv=16, d_ff=64, vocab_size=64,
                                            decoder_start_token_id=0, architectures=["T5ForConditionalGeneration"]),
        "falcon": lambda: transformers.FalconConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                                    vocab_size=64, new_decoder_architecture=False,
                                                    architectures=["FalconForCausalLM"]),
        "resnet": lambda: transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=5,
                                                    architectures=["ResNetForImageClassification"]),
        "mixtral": lambda: transformers.MixtralConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=4,
                                                      num_key_value_heads=2, intermediate_size=64, num_local_experts=4,
                                                      num_experts_per_tok=2, vocab_size=64, max_position_embeddings=16,
                                                      bos_token_id=0, eos_token_id=0, pad_token_id=0,
                                                      architectures=["MixtralForCausalLM"]),
    }
    folder = root / name
    configs[name]().save_pretrained(folder)
    return folder


class _Factories(torch.nn.Module):
    """Keyed ``rand``/``randn`` (runtime/execute/randomness.py) and plain factories, as a model may
    write them: with no device."""

    def __init__(self, features: int = 8):
        super().__init__()
        self.first, self.second = torch.nn.Linear(features, features), torch.nn.Linear(features, features)

    def forward(self, x):
        h = self.first(x) + 0.01 * torch.rand(x.shape) + torch.full((x.shape[-1],), 0.5)
        return self.second(torch.relu(h)) * torch.ones(x.shape[-1]) + 0.01 * torch.randn(x.shape[-1])


def factories_workload():
    features = 8
    torch.manual_seed(0)
    return Workload(model=_Factories(features), example_args=(torch.zeros(2, features),), loss_fn=data.mse_loss,
                    make_batch=functools.partial(data.regression_batch, features=features, outputs=features, seed=0),
                    name="factories",
                    source={"make_batch": ("runtime.data.synthetic:regression_batch",
                                           {"features": features, "outputs": features, "seed": 0}),
                            "loss_fn": ("runtime.data.synthetic:mse_loss", {})})


OWN_MODEL = Path(__file__).resolve().parents[1] / "own_model"
# name -> (workload maker given a scratch folder, compile options)
_TINY = dict(width=32, vocab=64, seq=16)
MODELS = {
    # tensor-parallel stages, keyed (attention) dropout, and a region recomputed in backward on devices
    # of 330 KB (pinned: the memory model may fit it without): its method reads the device itself
    "gpt": (lambda root: gpt(layers=2, heads=2, dropout=0.1, **_TINY),
            dict(devices=4, tensor_parallel=2, memory_bytes=330_000, training={"recompute": "full"})),
    "hf-gpt2": (lambda root: hf_gpt2(layers=1, heads=2, dropout=0.1, **_TINY), {}),
    "hf-llama": (lambda root: hf_llama(layers=1, heads=4, dropout=0.1, **_TINY), {}),
    "hf-bert": (lambda root: hf_bert(layers=1, heads=2, dropout=0.1, **_TINY), {}),
    "hf-qwen2-moe": (lambda root: hf_qwen2_moe(layers=1, heads=2, **_TINY), {}),
    "cnn": (lambda root: bn_cnn(), {}),
    "factories": (lambda root: factories_workload(), {}),
    "hf-vit": (lambda root: load_workload(f"hf:{_hf_config(root, 'vit')}"), {}),
    "hf-t5": (lambda root: load_workload(f"hf:{_hf_config(root, 't5')},seq=8"), {}),
    "hf-falcon": (lambda root: load_workload(f"hf:{_hf_config(root, 'falcon')},seq=8"), {}),
    "hf-resnet": (lambda root: load_workload(f"hf:{_hf_config(root, 'resnet')},image=16"), {}),
    "hf-mixtral": (lambda root: load_workload(f"hf:{_hf_config(root, 'mixtral')},seq=8"), {}),
    # keyword inputs with an attention mask, the loss computed by the model from its labels
    "hf-labels": (lambda root: load_workload(f"{OWN_MODEL / 'hf_labels_model.py'}:build"), {}),
}


def h100s(count: int, memory_bytes: int | None = None) -> ClusterSpec:
    memory = {"memory_bytes": memory_bytes, "memory_reserve_bytes": 0} if memory_bytes else {}
    return ClusterSpec.from_dict({"group": [{"kind": "h100", "count": count, **memory}]})


def _compiled(name: str, root) -> tuple:
    make, options = MODELS[name]
    options = dict(options)
    cluster = h100s(options.pop("devices", 2), options.pop("memory_bytes", None))
    plan = partitioner.compile(make(root), cluster=cluster, global_batch=4, num_stages=2, microbatches=2,
                               **{"tensor_parallel": 1, **options})
    plan.save(root / "program")
    return plan, root / "program"


@pytest.mark.parametrize("name", list(MODELS))
def test_gpu_compiles_make_every_tensor_on_the_stage_device(name, tmp_path_factory):
    """Compiled for h100s at the default precision (bf16-mixed), then every stage run on meta:
    no op meets a CPU tensor and none makes one."""
    plan, folder = _compiled(name, tmp_path_factory.mktemp(name))
    assert plan.device_type == "cuda" and plan.decisions.precision == "bf16-mixed"
    if name == "gpt":
        assert plan.tensor_parallel == 2 and any(r.recompute for r in plan.regions), "meant to cover tp and recompute"
    hits = off_device_ops(folder)
    assert not hits, "\n".join(hits)


def test_the_check_names_a_cpu_factory_and_the_op_it_meets(tmp_path):
    """The check above can fail: a stage whose arange takes no device (as the stage code of every
    transformer read before the fix) is caught at the factory and where the tensor meets a weight."""
    class Positions(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(8, 4)

        def forward(self):
            return self.emb(torch.arange(8))

    module = Positions().to("meta")
    mode = _OffDevice()
    with mode:
        module()
    assert mode.hits == ["a tensor made on the cpu by aten.arange.default",
                         "mixed devices ['cpu', 'meta'] in aten.embedding.default"]


def test_bf16_mixed_on_cpu_compiles_a_model_that_casts_an_activation(tmp_path):
    """Mixtral's router casts its logits (``.float()``): export guards the cast with an
    ``_assert_tensor_metadata`` of the traced fp32, which the autocast probe used to run on the
    bf16 logits and refuse (the stages drop those asserts anyway)."""
    workload = MODELS["hf-mixtral"][0](tmp_path)
    plan = partitioner.compile(workload, cluster=ClusterSpec.homogeneous(2, "cpu"), global_batch=4, num_stages=2,
                               microbatches=2, tensor_parallel=1, precision="bf16-mixed")
    assert plan.decisions.precision == "bf16-mixed"
    plan.save(tmp_path / "program")
    assert (tmp_path / "program" / "stage_1.py").is_file()
