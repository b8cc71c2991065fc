"""The first save of a compile takes the compile's own trace where the plan's microbatch size is the
example batch (Note [one trace when the sizes agree] in partitioner/codegen/lower.py): the folder it
writes is, byte for byte, the folder a fresh trace writes. The models are those whose lowering does
the most with the graph: tensor-parallel roles with keyed dropout, a Hugging Face model's
keyed attention, BatchNorm buffers that update in place."""

from __future__ import annotations

from pathlib import Path

import pytest

from _bn_workload import workload as bn_workload
from _programs import compile_to
from partitioner.models.builtin import gpt, hf_llama

CASES = {
    "gpt_tp2_dropout": (lambda: gpt(layers=2, width=32, heads=4, vocab=64, seq=8, batch=2, dropout=0.1),
                        dict(devices=4, num_stages=2, tensor_parallel=2, global_batch=4, microbatches=2)),
    "hf_llama": (lambda: hf_llama(layers=2, width=32, heads=4, vocab=64, seq=8, batch=2, dropout=0.1),
                 dict(devices=2, num_stages=2, global_batch=4, microbatches=2)),
    "batchnorm": (bn_workload, dict(devices=2, num_stages=2, global_batch=4, microbatches=2)),
}


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_save_from_the_compiles_trace_writes_what_a_fresh_trace_writes(tmp_path, case):
    make, options = CASES[case]
    workload = make()
    compiled = compile_to(tmp_path / "reused", workload, **options)  # the first save: compile's trace
    assert compiled.plan.microbatch_size == workload.example_batch_size  # so the reuse was taken
    assert compiled.first_trace is None  # taken once
    compiled.save(tmp_path / "fresh")  # the second save traces again
    reused, fresh = _files(tmp_path / "reused"), _files(tmp_path / "fresh")
    assert sorted(reused) == sorted(fresh)
    assert [name for name in reused if reused[name] != fresh[name]] == []
