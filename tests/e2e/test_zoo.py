"""The zoo of third-party model shapes (issue 41; tests/_zoo.py says which library file each copies):
a resnet, a mobilenet_v3 with its in-place dropout head, a ConvNeXt and an EfficientNet with
torchvision's StochasticDepth, a ViT with timm's DropPath and attention dropout, and nanoGPT's
model.py (tied head, loss inside forward) with drop path. Each compiles to 2 stages (dp 1), trains
3 steps in train mode with every drop on, and verifies bit for bit against the one-process oracle
(Note [in-place random ops] in runtime/execute/randomness.py). The jobs join the session's 2-rank
shared launch (Note [shared launches] in tests/_shared_launch.py)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

import _zoo
from _programs import compile_to
from _shared_launch import Job, prepare
from partitioner.cli.verify import check_run
from partitioner.frontend.workload import Workload
from runtime.data import hf_tasks

MODELS = {"resnet": _zoo.ResNet, "mobilenet_v3": _zoo.MobileNetV3, "convnext": _zoo.ConvNeXt,
          "efficientnet": _zoo.EfficientNet, "vit": _zoo.VisionTransformer, "nanogpt": _zoo.GPT}
IMAGES = {"channels": 3, "size": _zoo.IMAGE, "num_labels": _zoo.CLASSES, "seed": 0}


def workload(name: str) -> Workload:
    """The zoo model ``name`` in train mode, with its data and loss named for the ranks."""
    torch.manual_seed(0)
    model = MODELS[name]().train()
    if name == "nanogpt":
        return Workload(model=model, example_args=_zoo.gpt_batch(0, 2)[0], loss_fn=_zoo.own_loss,
                        make_batch=_zoo.gpt_batch, name=name,
                        source={"make_batch": (f"{_zoo.HERE}:gpt_batch", {}), "loss_fn": (f"{_zoo.HERE}:own_loss", {})})
    return Workload(model=model, example_args=hf_tasks.image_batch(0, 2, **IMAGES)[0],
                    loss_fn=hf_tasks.classification_loss, make_batch=functools.partial(hf_tasks.image_batch, **IMAGES),
                    name=name, source={"make_batch": ("runtime.data.hf_tasks:image_batch", IMAGES),
                                       "loss_fn": ("runtime.data.hf_tasks:classification_loss", {})})


@prepare
def _zoo_programs(root: Path):
    plans = {name: compile_to(root / name, workload(name), devices=2, num_stages=2, dp=1, global_batch=4,
                              microbatches=2, flops_per_s=1e9) for name in MODELS}
    jobs = [Job(2, [root / name, "--steps", "3", "--run-dir", root / f"run_{name}", "--checkpoint-dir",
                    root / f"ck_{name}"]) for name in MODELS]
    return (root, plans), jobs


@pytest.fixture(scope="module")
def zoo(shared_launches):
    return shared_launches.result(_zoo_programs)[0]


@pytest.mark.parametrize("name", list(MODELS))
def test_zoo_model_trains_on_two_stages_with_its_drops_on_and_verifies(zoo, name):
    root, plans = zoo
    assert plans[name].num_stages == 2 and plans[name].dp == 1
    report = check_run(root / name, root / f"run_{name}", workload=workload(name))
    assert report.ok, report.text()
    if name != "resnet":  # torchvision's resnet draws nothing: it is here for BatchNorm and in-place ReLU
        assert report.oracle.endswith("(keyed randomness)"), report.oracle
        first, second = (_gradients_under_seed(name, seed) for seed in (1, 2))
        assert not torch.equal(first, second), f"{name} trained with its drops off"


def _gradients_under_seed(name: str, seed: int) -> torch.Tensor:
    """The model's parameter gradients from one train-mode step on 16 rows: they differ between
    seeds only if the model draws (the loss may not: ConvNeXt's layer scale is 1e-6)."""
    wl = workload(name)
    inputs, target = wl.make_batch(0, 16)
    torch.manual_seed(seed)
    wl.loss_fn(wl.model(*inputs), target).backward()
    return torch.cat([p.grad.flatten() for p in wl.model.parameters() if p.grad is not None])
