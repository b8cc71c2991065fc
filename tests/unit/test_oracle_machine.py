"""verify's oracle computes as the ranks do (Note [the oracle computes as the ranks do] in
runtime/execute/reference.py): the ranks' thread count, the program's device type, refused in one
line where that device is missing, and a keyed graph traced here retargeted to the oracle's device.
The end-to-end check (a tiny ResNet-18 verified from a 2-thread process) is
tests/e2e/test_oracle_threads.py."""

from __future__ import annotations

import pytest
import torch

from runtime.execute.reference import computing_as_the_ranks
from runtime.launch.torchrun import RANK_THREADS, rank_threads, run_env


def test_rank_threads_are_what_run_env_gives_the_ranks():
    assert rank_threads({}) == RANK_THREADS == 1
    assert rank_threads({"OMP_NUM_THREADS": "4"}) == 4
    assert rank_threads({"OMP_NUM_THREADS": "3,2"}) == 3  # OpenMP's nested list: the first level
    assert int(run_env()["OMP_NUM_THREADS"].split(",")[0]) == rank_threads()
    for bad in ("", "0", "two"):
        with pytest.raises(ValueError, match=f"OMP_NUM_THREADS={bad!r} .*set e.g. OMP_NUM_THREADS=1"):
            rank_threads({"OMP_NUM_THREADS": bad})


def test_the_oracle_takes_the_ranks_threads_for_its_run_only():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with computing_as_the_ranks("cpu", threads=1):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(KeyError), computing_as_the_ranks("cpu", threads=1):
            raise KeyError("a failing oracle")
        assert torch.get_num_threads() == 2
        with computing_as_the_ranks("cpu"):  # no count: this process's
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_a_cuda_program_is_refused_in_one_line_where_its_oracle_cannot_run(tmp_path, capsys):
    import partitioner
    from _bn_workload import workload
    from partitioner.cli.commands import main
    from partitioner.cli.verify import check_run, verify
    from partitioner.config.cluster import ClusterSpec
    from runtime.execute.reference import OracleDeviceError

    # fp32: a bf16 compile for a GPU kind needs CUDA to probe its boundary dtypes here
    partitioner.compile(workload(), cluster=ClusterSpec.homogeneous(2, "h100"), global_batch=8,
                        precision="fp32").save(tmp_path / "out")
    want = "runs on cuda and its oracle must too .* no CUDA device: verify on a machine with a GPU, or compile for --device cpu"
    with pytest.raises(OracleDeviceError, match=want):
        verify(tmp_path / "out")  # before torchrun starts ranks that would fail on set_device
    with pytest.raises(OracleDeviceError, match=want):
        check_run(tmp_path / "out", tmp_path / "a run made on a GPU")  # not a CPU oracle, silently
    assert main(["verify", str(tmp_path / "out")]) != 0
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and said[0].startswith("error: ") and "--device cpu" in said[0], said


def test_a_keyed_graph_traced_here_trains_on_the_oracles_device():
    from partitioner.cli.verify import _retarget
    from partitioner.frontend.randomness import keyed_graph
    from partitioner.models.builtin import load_workload

    graph, _ = keyed_graph(load_workload("gpt:layers=1,width=16,heads=2,vocab=32,seq=8,dropout=0.1"), 2)

    def devices(gm):
        return {v.type for n in gm.graph.nodes for v in (*n.args, *n.kwargs.values()) if isinstance(v, torch.device)}

    assert devices(graph) == {"cpu"}  # the trace's position table: aten.arange(..., device=cpu)
    assert _retarget(graph, torch.device("cpu")) is graph and devices(graph) == {"cpu"}
    moved = _retarget(graph, torch.device("meta"))  # stands for cuda, which this machine may lack
    assert devices(moved) == {"meta"} and "device(type='meta')" in moved.code


def test_the_stage_chain_trains_where_it_is_asked_to_and_as_the_program_says_by_default(tmp_path):
    import partitioner
    from _bn_workload import workload
    from partitioner.config.cluster import ClusterSpec
    from runtime.execute.reference import train_reference_from_folder

    partitioner.compile(workload(), cluster=ClusterSpec.homogeneous(2, "cpu"), global_batch=8).save(tmp_path / "out")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        one, state, _ = train_reference_from_folder(str(tmp_path / "out"), 2, threads=1)
        assert torch.get_num_threads() == 2
        again, _, _ = train_reference_from_folder(str(tmp_path / "out"), 2, threads=1, device="cpu")
    finally:
        torch.set_num_threads(before)
    assert one == again and {t.device.type for t in state.values()} == {"cpu"}
