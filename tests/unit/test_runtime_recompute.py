"""runtime.execute.recompute.checkpointed (Note [cheap checkpointing]): the same outputs and gradients as the
plain forward, on both of its paths, with keyed dropout drawing the same masks in the rerun."""

import pytest
import torch

import runtime.execute.recompute as rc
from runtime.execute import randomness


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(8, 16)
        self.proj = torch.nn.Linear(16, 8)

    def region(self, x):
        h = randomness.dropout(torch.nn.functional.gelu(self.fc(x)), 0.5, True, op="dropout_1")
        return x + self.proj(h)


def _run(block, x, *, recompute: bool):
    randomness.set_context(seed=7, step=3, first_sample=0, microbatch=0)
    out = rc.checkpointed(block.region, x) if recompute else block.region(x)
    # Another microbatch's forward runs before this backward (1F1B): a later context is current.
    randomness.set_context(seed=7, step=3, first_sample=4, microbatch=1)
    out.backward(torch.ones_like(out))
    return out.detach(), {n: p.grad.clone() for n, p in block.named_parameters()}


@pytest.mark.parametrize("input_needs_grad", [True, False], ids=["reentrant", "no-grad input"])
def test_checkpointed_gives_the_plain_outputs_and_gradients(input_needs_grad):
    """With an input that needs grad the reentrant form runs; without one (a region reading only
    the batch) the non-reentrant form, whose parameters still get their gradients."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)).requires_grad_(input_needs_grad)
    plain_block, rc_block = Block(), Block()
    out_p, grads_p = _run(plain_block, x, recompute=False)
    out_r, grads_r = _run(rc_block, x, recompute=True)
    assert torch.equal(out_r, out_p)
    assert grads_r.keys() == grads_p.keys()
    for name in grads_p:
        assert torch.equal(grads_r[name], grads_p[name]), name


def test_the_check_fails_without_the_context_replayed(monkeypatch):
    monkeypatch.setattr(rc, "_replay", lambda fn, context, *args: fn(*args))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    _, grads_p = _run(Block(), x, recompute=False)
    _, grads_r = _run(Block(), x, recompute=True)
    assert any(not torch.equal(grads_r[n], grads_p[n]) for n in grads_p)


def test_no_grad_forward_skips_the_checkpoint():
    block = Block()
    randomness.set_context(seed=7, step=3, first_sample=0, microbatch=0)
    with torch.no_grad():
        out = rc.checkpointed(block.region, torch.randn(4, 8))
    assert out.grad_fn is None
