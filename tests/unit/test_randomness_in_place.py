"""The in-place random ops of vision models (Note [in-place random ops] in
runtime/execute/randomness.py), in one process: timm's DropPath, torchvision's stochastic depth and
nn.Dropout(inplace=True) lower to keyed draws whose masks a microbatch split draws as the whole
batch does; bernoulli_ with a tensor p, uniform_ and normal_ too; a write another view reads
afterwards, and a random op with no keyed twin, are refused naming the module and a fix."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from _vision_blocks import vision_workload
from partitioner.frontend.randomness import keyed_graph, lower_randomness
from partitioner.frontend.trace import trace
from runtime.execute import randomness


def _random_nodes(gm):
    return [n.name for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
            and torch.Tag.nondeterministic_seeded in n.target.tags]


def test_drop_path_stochastic_depth_and_in_place_dropout_draw_the_whole_batch_masks_in_any_split():
    workload = vision_workload(drop=0.5, layers=2)
    (tokens,), _ = workload.make_batch(0, 4)
    whole_gm, lowered = keyed_graph(workload, 4)
    # timm's DropPath, torchvision's stochastic_depth, the head's nn.Dropout(inplace=True)
    assert {(k.op, k.function, k.batch_dim) for k in lowered} == {
        ("bernoulli_", "drop_mask", 0), ("bernoulli__1", "drop_mask", 0), ("dropout_", "dropout", 0)}
    assert _random_nodes(whole_gm) == []
    half_gm, _ = keyed_graph(workload, 2)
    randomness.set_context(seed=0, step=3, first_sample=0, microbatch=0)
    whole = whole_gm(tokens)
    halves = []
    for i in range(2):
        randomness.set_context(seed=0, step=3, first_sample=2 * i, microbatch=i)
        halves.append(half_gm(tokens[2 * i:2 * i + 2]))
    torch.testing.assert_close(torch.cat(halves), whole, rtol=1e-5, atol=1e-5)
    # the drops are real: without them (eval), or at another step, the logits differ
    workload.model.eval()
    assert not torch.allclose(workload.model(tokens), whole)
    randomness.set_context(seed=0, step=4, first_sample=0, microbatch=0)
    assert not torch.allclose(whole_gm(tokens), whole)


@pytest.mark.parametrize("scale_by_keep", [True, False])
def test_evaluation_keeps_every_path_as_the_model_in_eval_mode_does(scale_by_keep):
    """Under dropout_off (Note [evaluation turns dropout off]) the compiled graph (traced in training
    mode) computes exactly what model.eval() does: drop paths and in-place dropout are identities."""
    from _vision_blocks import DropPath

    workload = vision_workload(drop=0.5, layers=2)
    for block in workload.model.blocks:
        block.drop_path = DropPath(0.5, scale_by_keep)
    (tokens,), _ = workload.make_batch(0, 4)
    gm, _ = keyed_graph(workload, 4)
    randomness.set_context(seed=0, step=0, first_sample=0, microbatch=0)
    with randomness.dropout_off():
        evaluated = gm(tokens)
    workload.model.eval()
    assert torch.equal(evaluated, workload.model(tokens))


def test_the_drop_path_mask_is_per_sample_and_scaled_by_the_keep_probability():
    class Path(nn.Module):
        def forward(self, x):
            return x * x.new_empty((x.shape[0], 1)).bernoulli_(0.5).div_(0.5)

    whole, half = (trace(Path(), (torch.ones(n, 3),)).gm for n in (64, 32))
    assert [k.batch_dim for k in lower_randomness(whole, batch_size=64)] == [0]
    assert [k.batch_dim for k in lower_randomness(half, batch_size=32)] == [0]
    randomness.set_context(seed=0, step=0, first_sample=0, microbatch=0)
    out = whole(torch.ones(64, 3))
    assert set(out.unique().tolist()) == {0.0, 2.0}
    assert all(len(set(row.tolist())) == 1 for row in out)  # one draw per sample, broadcast over the row
    randomness.set_context(seed=0, step=0, first_sample=32, microbatch=1)
    assert torch.equal(half(torch.ones(32, 3)), out[32:])


def test_bernoulli_with_a_tensor_p_uniform_and_normal_in_place_are_keyed():
    class Init(nn.Module):
        def forward(self, x):
            mask = torch.empty_like(x).bernoulli_(torch.full_like(x, 0.25))
            return x + mask + torch.empty_like(x).uniform_(-1.0, 3.0) + torch.empty_like(x).normal_(5.0, 0.5)

    gm = trace(Init(), (torch.zeros(2, 3),)).gm
    lowered = lower_randomness(gm, batch_size=2)
    assert sorted(k.function for k in lowered) == ["bernoulli", "normal", "uniform"]
    assert _random_nodes(gm) == []
    randomness.set_context(seed=0, step=0, first_sample=0, microbatch=0)
    x = torch.zeros(2, 4000)
    ctx = randomness.capture()
    mask, uniform, normal = (randomness.bernoulli(x, torch.full_like(x, 0.25), op="m", batch_dim=0),
                             randomness.uniform(x, -1.0, 3.0, op="u", batch_dim=0),
                             randomness.normal(x, 5.0, 0.5, op="n", batch_dim=0))
    assert abs(mask.mean().item() - 0.25) < 0.03 and set(mask.unique().tolist()) == {0.0, 1.0}
    assert uniform.min() >= -1.0 and uniform.max() < 3.0 and abs(uniform.mean().item() - 1.0) < 0.1
    assert abs(normal.mean().item() - 5.0) < 0.05 and abs(normal.std().item() - 0.5) < 0.05
    with randomness.restored(ctx):
        assert torch.equal(gm(torch.zeros(2, 3)), gm(torch.zeros(2, 3)))


def test_a_write_another_view_reads_and_an_unkeyable_op_are_refused_naming_the_module():
    class Viewed(nn.Module):
        def forward(self, x):
            mask = torch.empty_like(x)
            flat = mask.view(-1)
            mask.bernoulli_(0.5)  # the result is dropped: only `flat` carries the draw
            return x * flat.view_as(x)

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.noise = Viewed()

        def forward(self, x):
            return self.noise(x)

    gm = trace(Outer(), (torch.zeros(2, 3),)).gm
    with pytest.raises(ValueError) as info:
        lower_randomness(gm, batch_size=2)
    message = str(info.value)
    assert "module `noise`" in message and "another view" in message and "mask = mask.bernoulli_(p)" in message

    class Noisy(nn.Module):
        def forward(self, x):
            return x + torch.empty_like(x).exponential_()

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.jitter = Noisy()

        def forward(self, x):
            return self.jitter(x)

    gm = trace(Holder(), (torch.zeros(2, 3),)).gm
    with pytest.raises(ValueError) as info:
        lower_randomness(gm, batch_size=2)
    message = str(info.value)
    assert "exponential_" in message and "module `jitter`" in message and "torch.rand_like(x) < p" in message
    assert "partitioner/frontend/randomness.py" not in message
