"""Note [no pickle between ranks] in runtime/exchange.py: what ranks send each other is
JSON in byte tensors, so a peer that is not the job's rank can feed a rank wrong values, never code."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import pytest

from _runtime_folders import REPO

class _Planted:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_ranks_exchange_json_and_refuse_a_pickle(tmp_path):
    """A real gloo world (one rank: the code path of any size); then the bytes a hostile peer
    would send, a pickle that creates a file, decoded as the receiving rank decodes them."""
    import torch
    import torch.distributed as dist

    from runtime import exchange

    cpu = torch.device("cpu")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        assert exchange.all_gather_json({"rank": 0, "pair": (0, "é")}, cpu) == [{"rank": 0, "pair": [0, "é"]}]
        assert exchange.broadcast_json({"steps": (3, 4)}, 0, cpu) == {"steps": [3, 4]}
    finally:
        dist.destroy_process_group()
    marker = tmp_path / "pwned"
    planted = torch.frombuffer(bytearray(pickle.dumps(_Planted(str(marker)))), dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=r"rank 1 sent an exchange that is not JSON .*Trust model") as refused:
        exchange._decode(planted, 1)
    assert "\n" not in str(refused.value) and not marker.exists()
    with pytest.raises(RuntimeError, match=r"rank 1 sent a 9999999999-byte exchange"):
        exchange._checked(9_999_999_999, 1)


def test_the_runtime_calls_no_object_collective():
    """torch's object collectives unpickle what a peer sends: runtime/ uses exchange.py's instead."""
    banned = {"all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
              "send_object_list", "recv_object_list"}
    found = []
    for path in sorted(Path(REPO, "runtime").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
            if name in banned:
                found.append(f"{path.relative_to(REPO)}:{node.lineno} {name}")
    assert found == []
