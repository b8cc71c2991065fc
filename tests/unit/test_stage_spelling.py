"""Every row of the stage files' spelling table calls the same kernels with the same arguments as
the aten op it replaces (Note [exact spellings] in partitioner/codegen/spelling.py).

Each sample is one call node in a real FX graph, written by the stage emitter and run; the aten op
is called directly beside it. Both run under a dispatch log: the ops that reach the kernels, with
their arguments, must be the same, and the outputs and gradients equal bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from partitioner.codegen.spelling import IDENTITY_DROPOUTS, SPELLINGS, attribute, dropped_input
from partitioner.codegen.stage_code import _Emitter, _SourcePaths

aten = torch.ops.aten
CPU = torch.device("cpu")


def _f(*shape, grad=True):
    return torch.randn(*shape, dtype=torch.float32, requires_grad=grad)


def _leaf(t):
    """``t`` (a transposed or cast tensor) as a leaf whose gradient the test compares."""
    return t.detach().requires_grad_()


def _i(*shape, high=5):
    return torch.randint(0, high, shape)


def _b(*shape):
    return torch.randint(0, 2, shape).bool()


def _stays(make):
    """A sample whose arguments the row does not take: it stays the aten call (and runs the same)."""
    make.stays = True
    return make


# op -> samples, each () -> (args, kwargs); several where a row's arguments vary (scalars, defaults)
SAMPLES = {
    aten.add.Tensor: [lambda: ((_f(2, 3), _f(2, 3)), {}), lambda: ((_i(2, 3), 0.5), {}),
                      _stays(lambda: ((_f(2, 3), _f(2, 3)), {"alpha": 2}))],
    aten.sub.Tensor: [lambda: ((_f(2, 3), _f(3)), {}), lambda: ((_i(2, 3), 1), {})],
    aten.mul.Tensor: [lambda: ((_f(2, 3), 0.5), {}), lambda: ((_i(2, 3), 0.5), {}),
                      lambda: ((_leaf(_f(2, 3).to(torch.bfloat16)), 3.0), {})],
    aten.div.Tensor: [lambda: ((_f(2, 3), 8), {}), lambda: ((_i(2, 3), 2), {})],
    aten.matmul.default: [lambda: ((_f(2, 3, 4), _f(4, 5)), {})],
    aten.pow.Tensor_Scalar: [lambda: ((_f(2, 3), 3.0), {}), lambda: ((_f(2, 3), 2), {})],
    aten.neg.default: [lambda: ((_f(2, 3),), {})],
    **{op: [lambda: ((_i(2, 3), _i(2, 3)), {})] for op in (aten.eq.Tensor, aten.ne.Tensor, aten.lt.Tensor,
                                                           aten.le.Tensor, aten.gt.Tensor, aten.ge.Tensor)},
    **{op: [lambda: ((_i(2, 3), 2), {}), lambda: ((_f(2, 3, grad=False), 0.5), {})]
       for op in (aten.eq.Scalar, aten.ne.Scalar, aten.lt.Scalar, aten.le.Scalar, aten.gt.Scalar, aten.ge.Scalar)},
    aten.__and__.Tensor: [lambda: ((_b(2, 3), _b(2, 3)), {})],
    aten.__or__.Tensor: [lambda: ((_b(2, 3), _b(2, 3)), {})],
    aten.bitwise_not.default: [lambda: ((_b(2, 3),), {})],
    aten.linear.default: [lambda: ((_f(2, 3, 4), _f(5, 4), _f(5)), {}), lambda: ((_f(2, 4), _f(5, 4)), {}),
                          lambda: ((_f(2, 4), _f(5, 4), None), {})],
    aten.embedding.default: [lambda: ((_f(7, 4), _i(2, 3, high=7)), {}),
                             lambda: ((_f(7, 4), _i(2, 3, high=7), 0), {}),
                             _stays(lambda: ((_f(7, 4), _i(2, 3, high=7), -2), {}))],
    aten.layer_norm.default: [lambda: ((_f(2, 3, 8), [8], _f(8), _f(8), 1e-05, False), {}),
                              lambda: ((_f(2, 8), [8], _f(8), _f(8), 1e-06, True), {}),
                              lambda: ((_f(2, 8), [8]), {})],
    aten.gelu.default: [lambda: ((_f(2, 3),), {}), lambda: ((_f(2, 3),), {"approximate": "tanh"})],
    aten.silu.default: [lambda: ((_f(2, 3),), {})],
    aten.relu.default: [lambda: ((_f(2, 3),), {})],
    aten.softmax.int: [lambda: ((_f(2, 3), -1), {}), lambda: ((_f(2, 3), -1, torch.float32), {}),
                       lambda: ((_leaf(_f(2, 3).to(torch.bfloat16)), 1, torch.float32), {})],
    aten.scaled_dot_product_attention.default: [
        lambda: ((_f(2, 2, 4, 8), _f(2, 2, 4, 8), _f(2, 2, 4, 8), None, 0.0, True), {}),
        lambda: ((_f(2, 2, 4, 8), _f(2, 2, 4, 8), _f(2, 2, 4, 8), _f(2, 1, 4, 4, grad=False)), {"scale": 0.25})],
    aten.conv2d.default: [lambda: ((_f(1, 2, 6, 6), _f(3, 2, 3, 3), None, [1, 1], [1, 1]), {}),
                          lambda: ((_f(1, 2, 6, 6), _f(3, 2, 3, 3), _f(3)), {})],
    aten.max_pool2d.default: [lambda: ((_f(1, 2, 6, 6), [3, 3], [2, 2], [1, 1]), {})],
    aten.adaptive_avg_pool2d.default: [lambda: ((_f(1, 2, 6, 6), [1, 1]), {})],
    aten.pad.default: [lambda: ((_i(2, 3), [0, 1], "constant", -100.0), {}), lambda: ((_f(2, 3), [1, 1]), {})],
    aten.cross_entropy_loss.default: [lambda: ((_f(4, 5), _i(4)), {}),
                                      _stays(lambda: ((_f(4, 5), _i(4), None, 1, -100, 0.1), {}))],
    aten.addmm.default: [lambda: ((_f(5), _f(2, 4), _f(4, 5)), {})],
    aten.cat.default: [lambda: (([_f(2, 3), _f(2, 3)], -1), {})],
    aten.where.self: [lambda: ((_b(2, 3), _f(2, 3), _f(2, 3)), {})],
    aten.where.ScalarOther: [lambda: ((_b(2, 3), _f(2, 3), -3.4028234663852886e+38), {})],
    **{op: [lambda: ((_leaf(_f(2, 3).abs() + 0.5),), {})] for op in (
        aten.rsqrt.default, aten.sqrt.default, aten.exp.default, aten.log.default, aten.cos.default,
        aten.sin.default, aten.tanh.default, aten.sigmoid.default, aten.abs.default)},
    aten.gather.default: [lambda: ((_f(2, 3), 1, _i(2, 2, high=3)), {})],
    aten.min.other: [lambda: ((_f(2, 3), _f(2, 3)), {})],
    aten.max.other: [lambda: ((_i(2, 3), _i(2, 3)), {})],
    aten.diff.default: [lambda: ((_i(2, 5), 1, -1, _i(2, 1)), {})],
    aten.batch_norm.default: [lambda: ((_f(2, 3, 4, 4), _f(3), _f(3), torch.zeros(3), torch.ones(3), True, 0.1, 1e-05,
                                        False), {})],
    aten.arange.default: [lambda: ((16,), {"device": CPU, "pin_memory": False}),
                          lambda: ((5,), {"dtype": torch.float32, "device": CPU, "pin_memory": False})],
    aten.arange.start: [lambda: ((2, 9), {"device": CPU, "pin_memory": False})],
    aten.zeros.default: [lambda: (([1, 2, 4],), {"dtype": torch.float32, "device": CPU, "pin_memory": False})],
    aten.ones.default: [lambda: (([8],), {"device": CPU, "pin_memory": False})],
    aten.full.default: [lambda: (([8], 0.5), {"device": CPU, "pin_memory": False})],
    aten.zeros_like.default: [lambda: ((_f(2, 3),), {"pin_memory": False})],
    aten.ones_like.default: [lambda: ((_f(2, 3),), {"dtype": torch.bool, "pin_memory": False})],
    aten.empty_like.default: [lambda: ((_f(2, 3),), {"pin_memory": False})],
    aten.full_like.default: [lambda: ((_i(2, 3), 15), {"pin_memory": False})],
    aten.view.default: [lambda: ((_f(2, 6), [3, 4]), {})],
    aten.reshape.default: [lambda: ((_leaf(_f(6, 2).t()), [3, 4]), {})],
    aten.t.default: [lambda: ((_f(2, 6),), {})],
    aten.transpose.int: [lambda: ((_f(2, 3, 4), 1, 2), {})],
    aten.permute.default: [lambda: ((_f(2, 3, 4), [2, 0, 1]), {})],
    aten.unsqueeze.default: [lambda: ((_f(2, 3), 0), {})],
    aten.squeeze.dim: [lambda: ((_f(2, 1, 3), 1), {})],
    aten.expand.default: [lambda: ((_f(1, 3), [2, -1]), {})],
    aten.contiguous.default: [lambda: ((_leaf(_f(3, 2).t()),), {})],
    aten.flatten.using_ints: [lambda: ((_f(2, 3, 4), 1), {}), lambda: ((_f(2, 3, 4), 0, 1), {})],
    aten.split.Tensor: [lambda: ((_f(2, 6), 2, 1), {}), lambda: ((_f(6, 2), 4), {})],
    aten.chunk.default: [lambda: ((_f(2, 6), 2, -1), {})],
    aten.select.int: [lambda: ((_f(2, 3, 4), 1, 0), {})],
    aten.mean.dim: [lambda: ((_f(2, 3), [-1], True), {}), lambda: ((_f(2, 3), [0]), {})],
    aten.sum.dim_IntList: [lambda: ((_f(2, 3), [1]), {})],
    aten.cumsum.default: [lambda: ((_i(2, 3), -1), {})],
    aten.topk.default: [lambda: ((_f(2, 5), 2), {})],
    aten.to.dtype: [lambda: ((_f(2, 3), torch.bfloat16), {}), lambda: ((_f(2, 3), torch.float32), {}),
                    lambda: ((_f(2, 3), torch.float64, False, True), {})],
    aten.to.device: [lambda: ((_f(2, 3), CPU, torch.float32), {})],
    aten.type_as.default: [lambda: ((_i(2, 3), _f(2, 3)), {})],
    aten.new_ones.default: [lambda: ((_f(2, 3), []), {"dtype": torch.bool, "pin_memory": False})],
    aten.add_.Tensor: [lambda: ((_i(3), 1), {})],
    aten.mul_.Tensor: [lambda: ((_f(3, grad=False), 2.0), {})],
    aten.div_.Tensor: [lambda: ((_f(3, grad=False), _f(3, grad=False)), {})],
    aten.index_put_.default: [lambda: ((torch.zeros(5), [_i(3)], torch.ones(3)), {})],
    aten.masked_fill.Scalar: [lambda: ((_f(2, 3), _b(2, 3), -1e9), {})],
    aten.numpy_T.default: [lambda: ((_f(2, 3),), {})],
}


def _spelled_call(op, args, kwargs) -> tuple[str, object]:
    """The emitter's statement for one call of ``op`` and the function it defines."""
    graph = fx.Graph()
    tensors = []

    def placeholder(value):
        if not isinstance(value, torch.Tensor):
            return value
        node = graph.placeholder(f"t{len(tensors)}")
        node.meta["val"] = value
        tensors.append(value)
        return node

    node = graph.call_function(op, tree_map(placeholder, args), tree_map(placeholder, kwargs))
    graph.output(node)
    emitter = _Emitter(_SourcePaths(), {})
    text = "\n".join(emitter.function(graph, "spelled"))
    namespace = {}
    exec("import torch\nimport torch.nn.functional as F\n" + text, namespace)
    return text, namespace["spelled"]


class _Log(TorchDispatchMode):
    """What reaches the kernels: each op with its arguments (tensors by shape, dtype, strides and,
    when small, values)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        def seen(v):
            if isinstance(v, torch.Tensor):
                return ("T", v.dtype, tuple(v.shape), v.stride(), v.tolist() if v.numel() <= 1 else None)
            return v
        self.calls.append((func, tree_map(seen, args), tree_map(seen, kwargs or {})))
        return func(*args, **(kwargs or {}))


def _run(fn, make):
    torch.manual_seed(0)
    args, kwargs = make()
    with _Log() as log:
        out = fn(args, kwargs)
    leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    grads = []
    if leaves and any(o.requires_grad for o in outs):
        torch.autograd.backward([o.float().sum() for o in outs if o.requires_grad])
        grads = [leaf.grad for leaf in leaves]
    return log.calls, outs, grads


def _same(a, b, values=True):
    return a is None and b is None or (a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
                                       and (torch.equal(a, b) or not values))


@pytest.mark.parametrize("op", list(SPELLINGS), ids=str)
def test_each_spelling_calls_the_same_kernels_with_the_same_arguments(op):
    assert op in SAMPLES, f"{op} has no sample here: each row of SPELLINGS is tested"
    for make in SAMPLES[op]:
        torch.manual_seed(0)
        args, kwargs = make()
        text, spelled = _spelled_call(op, args, kwargs)
        was_spelled = "torch.ops.aten" not in text
        direct = _run(lambda a, k: op(*a, **k), make)
        emitted = _run(lambda a, k: spelled(None, *[t for t in tree_flatten((a, k))[0] if isinstance(t, torch.Tensor)]),
                       make)
        assert direct[0] == emitted[0], f"{text}\nreached {emitted[0]}\ninstead of {direct[0]}"
        values = op is not aten.empty_like.default  # its values are whatever the memory held
        assert len(direct[1]) == len(emitted[1]) and all(_same(a, b, values) for a, b in zip(direct[1], emitted[1])), text
        assert len(direct[2]) == len(emitted[2]) and all(map(_same, direct[2], emitted[2])), text
        assert was_spelled != getattr(make, "stays", False), f"the row applied wrongly to this sample: {text}"


def test_a_row_leaves_a_call_it_does_not_take_as_aten():
    """``alpha`` has no operator: ``add(x, y, alpha=2)`` stays the aten call."""
    text, _ = _spelled_call(aten.add.Tensor, (_f(2), _f(2)), {"alpha": 2})
    assert "torch.ops.aten.add.Tensor(t0, t1, alpha=2)" in text
    text, _ = _spelled_call(aten.add.Tensor, (_f(2), _f(2)), {})
    assert "add_tensor = t0 + t1" in text


def test_a_dropout_that_draws_nothing_is_its_input():
    """aten's dropout returns its very input at p = 0 or train False, and dispatches nothing."""
    x = _f(2, 3)
    for op in IDENTITY_DROPOUTS:
        with _Log() as log:
            assert op(x, 0.0, True) is x and op(x, 0.5, False) is x
        assert log.calls == []
        assert dropped_input(op, (x, 0.0, True), {}) is x and dropped_input(op, (x, 0.5, False), {}) is x
        assert dropped_input(op, (x, 0.1, True), {}) is None


def test_module_paths_index_a_list_and_keep_a_name_that_is_not_an_identifier():
    assert attribute("self", "blocks.0.ln_1.weight") == "self.blocks[0].ln_1.weight"
    assert attribute("self", "h.12.attn.c_attn.bias") == "self.h[12].attn.c_attn.bias"
    assert attribute("self", "experts.a-b.w") == "self.experts['a-b'].w"
    assert attribute("self", "0.weight") == 'getattr(self, "0").weight'


def test_a_program_without_dropout_calls_none_and_computes_the_models_output_bit_for_bit(tmp_path):
    """gpt(dropout=0) traced with nn.Dropout(0.0) layers: the stage files call no dropout, read
    their list children by index, spell no aten op this model uses, and the two stages chained give
    the model's own output (train mode) bit for bit."""
    import partitioner
    from partitioner.config.cluster import ClusterSpec
    from partitioner.models.builtin import gpt
    from runtime.execute.stage import build_stage

    torch.manual_seed(0)
    workload = gpt(layers=1, width=16, heads=2, vocab=32, seq=8, dropout=0.0)
    model = workload.model
    plan = partitioner.compile(workload, cluster=ClusterSpec.homogeneous(2, "cpu"), global_batch=4, num_stages=2,
                               microbatches=2)
    plan.save(tmp_path / "prog")
    texts = [(tmp_path / "prog" / f"stage_{k}.py").read_text() for k in (0, 1)]
    assert not any("dropout" in text.split("class Stage")[1] for text in texts)
    assert not any("torch.ops.aten" in text or "getattr(self" in text for text in texts)
    assert "self.blocks[0].ln_1.weight" in texts[0] + texts[1]
    tokens = torch.randint(0, 32, (2, 8))
    stages = [build_stage(str(tmp_path / "prog"), k) for k in (0, 1)]
    model.train()
    assert torch.equal(stages[1](stages[0](tokens)), model(tokens))


class _TwoDropouts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.off, self.on = torch.nn.Dropout(0.0), torch.nn.Dropout(0.2)

    def forward(self, x):
        return self.second(self.on(self.first(self.off(x))))


def test_leaving_out_a_dropout_that_draws_nothing_moves_no_other_draws_key(tmp_path):
    """The p = 0 dropout is the graph's ``dropout``, the keyed one ``dropout_1``: the stage file
    calls only the keyed one, still under its name in the whole graph (Note [exact spellings])."""
    import functools

    import partitioner
    from partitioner.config.cluster import ClusterSpec
    from partitioner.frontend.workload import Workload
    from runtime.data import synthetic as data

    torch.manual_seed(0)
    workload = Workload(model=_TwoDropouts(), example_args=(torch.zeros(2, 8),), loss_fn=data.mse_loss,
                        make_batch=functools.partial(data.regression_batch, features=8, outputs=8, seed=0),
                        name="two_dropouts")
    plan = partitioner.compile(workload, cluster=ClusterSpec.homogeneous(1, "cpu"), global_batch=4, num_stages=1,
                               microbatches=2)
    plan.save(tmp_path / "prog")
    forward = (tmp_path / "prog" / "stage_0.py").read_text().split("class Stage0")[1]
    assert "torch.ops.aten.dropout" not in forward and forward.count("dropout(") == 1
    assert "randomness.dropout(linear, 0.2, True, op='dropout_1', batch_dim=0)" in forward
    assert "linear = F.linear(x, self.first.weight, self.first.bias)" in forward
