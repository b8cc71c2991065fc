"""Randomness keyed by meaning (Note [randomness keyed by meaning] in runtime/execute/randomness.py), in one
process: the keyed draws are functions of (seed, step, sample or microbatch, op) alone, a
microbatch split draws the whole batch's rows, capture/restored replays a context, and the lowering
keys every random node of a traced model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from partitioner.models.builtin import gpt
from partitioner.frontend.randomness import keyed_graph, lower_randomness
from partitioner.frontend.trace import trace
from runtime.execute import randomness

X = torch.ones(4, 3, 5)


def _drop(*, seed=0, step=0, first_sample=0, microbatch=0, x=X, op="dropout_1", batch_dim=0, p=0.5):
    randomness.set_context(seed=seed, step=step, first_sample=first_sample, microbatch=microbatch)
    return randomness.dropout(x, p, True, op=op, batch_dim=batch_dim)


def test_keyed_dropout_is_a_function_of_seed_step_sample_and_op():
    base = _drop()
    assert torch.equal(base, _drop())  # deterministic, whatever the global generator did since
    torch.manual_seed(123)
    assert torch.equal(base, _drop())
    assert set(base.unique().tolist()) == {0.0, 2.0}  # kept elements scaled by 1 / (1 - p)
    for changed in (dict(seed=1), dict(step=1), dict(op="dropout_2")):
        assert not torch.equal(base, _drop(**changed)), changed
    rows = [base[i] for i in range(4)]
    assert all(not torch.equal(rows[i], rows[j]) for i in range(4) for j in range(i))  # per sample
    # with a batch dimension the microbatch index plays no part: only the sample's index does
    assert torch.equal(base, _drop(microbatch=7))


def test_a_microbatch_split_draws_the_whole_batch_rows():
    whole = _drop(x=torch.ones(6, 2, 7))
    parts = [_drop(x=torch.ones(2, 2, 7), first_sample=2 * i, microbatch=i) for i in range(3)]
    assert torch.equal(whole, torch.cat(parts))
    # a batch dimension other than 0 (sequence-first tensors): rows follow that dimension
    whole_t = _drop(x=torch.ones(2, 6, 7), batch_dim=1)
    part_t = _drop(x=torch.ones(2, 3, 7), batch_dim=1, first_sample=3, microbatch=1)
    assert torch.equal(whole_t[:, 3:], part_t)
    assert torch.equal(whole_t.transpose(0, 1), whole)  # the same samples, the same masks


def test_a_tensor_without_batch_dimension_is_keyed_by_microbatch():
    a = _drop(batch_dim=None, microbatch=0)
    assert torch.equal(a, _drop(batch_dim=None, microbatch=0, first_sample=9))
    assert not torch.equal(a, _drop(batch_dim=None, microbatch=1))


def test_dropout_keeps_the_expected_fraction_and_its_gradient_is_the_mask():
    x = torch.ones(64, 256, requires_grad=True)
    out = _drop(x=x, p=0.1)
    out.sum().backward()
    kept = float((out != 0).float().mean())
    assert abs(kept - 0.9) < 0.01
    assert torch.equal(x.grad, out.detach())  # d(out)/dx = mask / (1 - p) = out for x = 1


def test_capture_and_restored_replay_a_forward_under_a_later_context():
    randomness.set_context(seed=3, step=2, first_sample=4, microbatch=2)
    snapshot = randomness.capture()
    first = randomness.dropout(X, 0.5, True, op="d", batch_dim=0)
    randomness.set_context(seed=3, step=2, first_sample=8, microbatch=4)  # a later microbatch
    later = randomness.dropout(X, 0.5, True, op="d", batch_dim=0)
    with randomness.restored(snapshot):
        assert torch.equal(randomness.dropout(X, 0.5, True, op="d", batch_dim=0), first)
    assert torch.equal(randomness.dropout(X, 0.5, True, op="d", batch_dim=0), later)  # put back


def test_recompute_under_checkpoint_redraws_the_forward_masks():
    """The recompute runs in backward, after the context moved on to a later microbatch."""
    import contextlib

    from torch.utils.checkpoint import checkpoint

    def block(x):
        return randomness.dropout(x * 3.0, 0.5, True, op="d", batch_dim=0)

    def grads(recompute: bool):
        x = torch.ones(4, 6, requires_grad=True)
        randomness.set_context(seed=0, step=1, first_sample=0, microbatch=0)
        if recompute:
            out = checkpoint(block, x, use_reentrant=False, context_fn=lambda: (
                contextlib.nullcontext(), randomness.restored(randomness.capture())))
        else:
            out = block(x)
        randomness.set_context(seed=0, step=1, first_sample=4, microbatch=1)
        out.sum().backward()
        return x.grad

    assert torch.equal(grads(True), grads(False))


def test_keyed_attention_matches_sdpa_without_dropout_and_drops_probabilities_with_it():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 6, 8) for _ in range(3))
    k2, v2 = k[:, :2], v[:, :2]
    bool_mask = torch.rand(6, 6) > 0.3
    bool_mask.fill_diagonal_(True)
    randomness.set_context(seed=0, step=0, first_sample=0, microbatch=0)
    for kwargs in (dict(is_causal=True), dict(attn_mask=bool_mask), dict(attn_mask=torch.randn(6, 6)),
                   dict(is_causal=True, scale=0.3)):
        want = F.scaled_dot_product_attention(q, k, v, **kwargs)
        # dropout_p tiny but nonzero: the explicit path, whose mask keeps everything
        got = randomness.attention(q, k, v, dropout_p=1e-12, op="a", **kwargs)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    want = F.scaled_dot_product_attention(q, k2, v2, is_causal=True, enable_gqa=True)
    got = randomness.attention(q, k2, v2, None, 1e-12, True, enable_gqa=True, op="a")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    dropped = randomness.attention(q, k, v, None, 0.5, True, op="a")
    assert not torch.allclose(dropped, F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_no_context_is_a_clear_error():
    with randomness.restored(None):
        with pytest.raises(RuntimeError, match="set_context"):
            randomness.dropout(X, 0.5, True, op="d", batch_dim=0)


def _random_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
            and torch.Tag.nondeterministic_seeded in n.target.tags]


def test_lowering_keys_every_random_node_of_a_traced_gpt():
    workload = gpt(layers=2, width=32, heads=2, vocab=64, seq=16, dropout=0.1)
    gm = trace(workload.model, workload.example_args).gm
    before = [n.name for n in _random_nodes(gm)]
    assert len(before) == 7  # embedding dropout, and per block: attention, its output, the MLP's
    lowered = lower_randomness(gm, batch_size=2)
    assert [k.op for k in lowered] == before  # named as in the unpartitioned graph
    assert {k.function for k in lowered} == {"dropout", "attention"}
    assert _random_nodes(gm) == []
    assert all(k.batch_dim == 0 for k in lowered)


def test_lowering_keys_factories_and_bernoulli_by_sample_or_microbatch():
    class Noise(torch.nn.Module):
        def forward(self, x):
            a = torch.bernoulli(torch.sigmoid(x)) + torch.bernoulli(x, 0.3) + torch.rand_like(x)
            return a + torch.randn(x.shape[0], 3) + torch.rand(3) + torch.randn_like(x)

    gm = trace(Noise(), (torch.zeros(2, 3),)).gm
    lowered = {k.function: k.batch_dim for k in lower_randomness(gm, batch_size=2)}
    assert lowered == {"bernoulli": 0, "rand_like": 0, "randn": 0, "rand": None, "randn_like": 0}
    assert _random_nodes(gm) == []
    randomness.set_context(seed=0, step=0, first_sample=0, microbatch=0)
    assert torch.equal(gm(torch.zeros(2, 3)), gm(torch.zeros(2, 3)))


def test_lowering_leaves_dropout_free_models_alone_and_refuses_unknown_random_ops():
    workload = gpt(layers=1, width=32, heads=2, vocab=64, seq=16, dropout=0.0)
    gm = trace(workload.model, workload.example_args).gm
    code = gm.code
    assert lower_randomness(gm, batch_size=2) == [] and gm.code == code

    class Noisy(torch.nn.Module):
        def forward(self, x):
            return x + torch.randint(0, 3, x.shape)

    gm = trace(Noisy(), (torch.zeros(2, 3),)).gm
    with pytest.raises(ValueError, match="randint.*cannot be keyed"):
        lower_randomness(gm, batch_size=2)


def test_the_keyed_graph_draws_per_sample_whatever_the_microbatch_size():
    """The oracle's graph traced at microbatch 4, and at 2 run twice: the same logits row by row."""
    workload = gpt(layers=1, width=32, heads=2, vocab=64, seq=8, dropout=0.5)
    (tokens,), _ = workload.make_batch(0, 4)
    whole_gm, lowered = keyed_graph(workload, 4)
    assert [k.function for k in lowered] == ["dropout", "attention", "dropout", "dropout"]
    half_gm, _ = keyed_graph(workload, 2)
    randomness.set_context(seed=0, step=5, first_sample=0, microbatch=0)
    whole = whole_gm(tokens)
    halves = []
    for i in range(2):
        randomness.set_context(seed=0, step=5, first_sample=2 * i, microbatch=i)
        halves.append(half_gm(tokens[2 * i:2 * i + 2]))
    torch.testing.assert_close(torch.cat(halves), whole, rtol=1e-5, atol=1e-5)
    randomness.set_context(seed=0, step=6, first_sample=0, microbatch=0)
    assert not torch.allclose(whole_gm(tokens), whole)


def _python_uniform(k: int, j: int) -> float:
    """Note [device-independent draws] in Python integers: the definition the tensors must meet."""
    mask = (1 << 64) - 1
    z = (k + (j + 1) * randomness._GOLDEN) & mask
    z = ((z ^ (z >> 30)) * randomness._MIX1) & mask
    z = ((z ^ (z >> 27)) * randomness._MIX2) & mask
    z ^= z >> 31
    return (z >> 40) / (1 << 24)


def test_keyed_draws_are_the_hash_of_key_and_index_in_python_integers():
    # Keys across the whole 63-bit range (sign bits, wrap-around of the int64 multiply) and
    # counters past 2**32: the tensor ops give exactly the integers' values, on any device.
    keys = [0, 1, (1 << 62) + 12345, (1 << 63) - 1, randomness.key(3, 5, 0, 7, "dropout_9")]
    first = (1 << 33) - 3
    drawn = randomness.hashed_uniform(
        torch.tensor([randomness._signed64(k) for k in keys], dtype=torch.int64), 6, first=first)
    expected = torch.tensor([[_python_uniform(k, first + j) for j in range(6)] for k in keys])
    assert torch.equal(drawn, expected)


def test_keyed_draws_are_uniform_and_normal_enough():
    randomness.set_context(seed=0, step=0, first_sample=0, microbatch=0)
    u = randomness._draw((8, 50_000), op="rand_1", batch_dim=0, device=torch.device("cpu"), normal=False)
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.005 and abs(float(u.var()) - 1 / 12) < 0.002
    # neighbouring elements and neighbouring samples are not correlated
    assert abs(float(torch.corrcoef(torch.stack([u[0, :-1], u[0, 1:]]))[0, 1])) < 0.02
    assert abs(float(torch.corrcoef(u[:2])[0, 1])) < 0.02
    n = randomness._draw((4, 50_000), op="randn_1", batch_dim=0, device=torch.device("cpu"), normal=True)
    assert torch.isfinite(n).all()
    assert abs(float(n.mean())) < 0.02 and abs(float(n.std()) - 1.0) < 0.02


def test_an_empty_draw_is_empty():
    randomness.set_context(seed=0, step=0, first_sample=0, microbatch=0)
    cpu = torch.device("cpu")
    assert randomness._draw((0, 4), op="e", batch_dim=0, device=cpu, normal=False).shape == (0, 4)
    assert randomness._draw((3, 0), op="e", batch_dim=0, device=cpu, normal=True).shape == (3, 0)
