"""A multi-node run says at start-up when its checkpoint folder is not one folder for every node
(Note [shared checkpoint folder] in runtime/resilience/checkpoint/shared.py). Two real gloo processes on
"hosts" 0 and 1; node-local disks are played by giving each rank its own folder."""

from __future__ import annotations

import os

from tests._spawned import run_ranks

from runtime.resilience.checkpoint.shared import check_shared, unshared_hosts


def _rank(rank: int, init_file: str, cases: list[list[str]], out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from datetime import timedelta

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    answers = [check_shared(folders[rank], rank, (0, 1), torch.device("cpu")) for folders in cases]
    with open(f"{out}.{rank}", "w") as f:
        f.write(";".join(",".join(map(str, missing)) for missing in answers))
    dist.destroy_process_group()


def _run(tmp_path, cases):
    """One 2-process group (spawned once: importing torch is the slow part) answers every case."""
    out = str(tmp_path / "answers")
    run_ranks(_rank, lambda r: (r, str(tmp_path / "init"), cases, out))
    return [open(f"{out}.{r}").read().split(";") for r in range(2)]


def test_a_folder_each_node_sees_alone_is_reported_and_a_shared_one_is_not(tmp_path):
    shared = str(tmp_path / "shared")
    local = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    for path in [shared] + local:
        os.makedirs(path)
    answers = _run(tmp_path, [[shared, shared], local])
    assert answers == [["", "1"], ["", "1"]]  # by rank: the shared folder, then the node-local ones
    assert os.listdir(shared) == []  # the marker is gone


def test_unshared_hosts():
    assert unshared_hosts([True, True, False, False], (0, 0, 1, 1)) == [1]
    assert unshared_hosts([True] * 4, (0, 0, 1, 1)) == []
