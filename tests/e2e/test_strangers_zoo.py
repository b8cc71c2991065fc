"""A stranger's ordinary models (issue 26): written the natural way, each compiles, runs and
verifies against the one-process oracle, or is refused at compile time with the reason and the fix.

Recurrent layers: nn.GRU, nn.LSTM and nn.RNN trace to one fused aten op tagged random for its
dropout between layers; without that dropout they draw nothing and run as they are (Note
[recurrent dropout] in partitioner/frontend/randomness.py). The jobs join the session's 2-rank
shared launch (Note [shared launches] in tests/_shared_launch.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

from _programs import compile_to
from _shared_launch import Job, prepare
from partitioner.cli.verify import check_run
from partitioner.frontend.workload import Workload
from runtime.data import synthetic as data

VOCAB, SEQ = 32, 6
RECURRENT = {"gru": nn.GRU, "lstm": nn.LSTM, "rnn": nn.RNN}


class RecurrentLM(nn.Module):
    """Embedding, a 2-layer batch-first recurrent layer, a head: a language model as a tutorial writes it."""

    def __init__(self, kind: str, width: int = 16, dropout: float = 0.0, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.rnn = RECURRENT[kind](width, width, num_layers=layers, batch_first=True, dropout=dropout)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens):
        out, _ = self.rnn(self.embed(tokens))
        return self.head(out)


def recurrent_workload(kind: str, **options) -> Workload:
    torch.manual_seed(0)
    batch = {"vocab": VOCAB, "seq": SEQ, "seed": 0}
    return Workload(
        model=RecurrentLM(kind, **options), example_args=data.token_batch(0, 2, **batch)[0],
        loss_fn=data.causal_lm_loss, make_batch=lambda step, size: data.token_batch(step, size, **batch),
        name=f"{kind}-lm",
        source={"make_batch": ("runtime.data.synthetic:token_batch", batch), "loss_fn": ("runtime.data.synthetic:causal_lm_loss", {})})


# kind -> (stages, dp): a pipeline cut before or after the recurrent op, and a data-parallel copy
LAYOUTS = {"gru": (2, 1), "lstm": (2, 1), "rnn": (1, 2)}


@prepare
def _recurrent_programs(root: Path):
    for kind, (stages, dp) in LAYOUTS.items():
        compile_to(root / kind, recurrent_workload(kind), devices=2, num_stages=stages, dp=dp, global_batch=4,
                   microbatches=2, flops_per_s=1e9)
    jobs = [Job(2, [root / kind, "--steps", "2", "--run-dir", root / f"run_{kind}", "--checkpoint-dir",
                    root / f"ck_{kind}"]) for kind in LAYOUTS]
    return root, jobs


@pytest.fixture(scope="module")
def recurrent(shared_launches):
    return shared_launches.result(_recurrent_programs)[0]


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_gru_lstm_and_rnn_without_dropout_compile_run_and_verify(recurrent, kind):
    report = check_run(recurrent / kind, recurrent / f"run_{kind}", workload=recurrent_workload(kind))
    assert report.ok, report.text()


def test_recurrent_dropout_between_layers_is_refused_with_the_fix_and_a_single_layer_is_not(tmp_path):
    """A 2-layer GRU with dropout 0.1 draws inside the fused op (no key): refused at compile time,
    naming the node, the module and the fix. One layer never drops (nn.GRU warns): it compiles."""
    import partitioner
    from partitioner.config.cluster import ClusterSpec

    cluster = ClusterSpec.homogeneous(1, "cpu")
    with pytest.raises(ValueError) as info:
        partitioner.compile(recurrent_workload("gru", dropout=0.1), cluster=cluster, global_batch=4)
    message = str(info.value)
    assert "aten.gru.input" in message and "module `rnn`" in message and "dropout=0.1" in message
    assert "set dropout=0" in message and "nn.Dropout" in message
    with pytest.warns(UserWarning, match="num_layers=1"):
        single = recurrent_workload("lstm", dropout=0.1, layers=1)
    partitioner.compile(single, cluster=cluster, global_batch=4)


def test_a_recurrent_layer_is_never_planned_on_a_tensor_group():
    """Note [no fused recurrent ops on a tensor group] holds: DTensor cannot run the fused op, so --tp 2
    is refused at compile time, and the search without --tp keeps tp 1."""
    import partitioner
    from partitioner.config.cluster import ClusterSpec

    cluster = ClusterSpec.homogeneous(2, "cpu")
    with pytest.raises(ValueError, match=r"tensor_parallel=2: node 'gru' calls aten.gru.input in module `rnn`.*--tp 1"):
        partitioner.compile(recurrent_workload("gru"), cluster=cluster, global_batch=4, num_stages=1,
                            tensor_parallel=2)
    plan = partitioner.compile(recurrent_workload("lstm"), cluster=cluster, global_batch=4, num_stages=1).plan
    assert plan.tensor_parallel == 1
