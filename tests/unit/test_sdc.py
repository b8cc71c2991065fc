"""Silent data corruption detection (Note [replica digests] in runtime/resilience/sdc.py), in one process:
every single flipped bit changes the digest, the odd replica is found by majority (and not
guessed with two replicas), --flip-bit flips exactly one bit and refuses what it cannot do, and
the check's cost in the cost model."""

from __future__ import annotations

import pytest
import torch

from runtime.resilience import faults
from runtime.resilience.sdc import find_mismatches, tensor_digest


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int8])
def test_every_single_bit_flip_changes_the_digest(dtype):
    t = (torch.randn(37, generator=torch.Generator().manual_seed(0)) * 5).to(dtype)
    base = int(tensor_digest(t))
    assert int(tensor_digest(t.clone())) == base
    raw = t.view(-1).view(torch.uint8)
    for byte in range(raw.numel()):
        for bit in range(8):
            flipped = raw.clone()
            flipped[byte] ^= 1 << bit
            assert int(tensor_digest(flipped.view(dtype))) != base, (byte, bit)


def test_the_odd_replica_is_found_by_majority():
    stages_of = {r: (r % 2,) for r in range(8)}
    good, bad = [5, 7], [5, 8]
    # 2 stages x dp 4: ranks (0, 2, 4, 6) hold stage 0, (1, 3, 5, 7) stage 1
    rows = [good] * 8
    assert find_mismatches(rows, [(0, 2, 4, 6), (1, 3, 5, 7)], stages_of) == []
    rows = [good] * 8
    rows[4] = bad
    (f,) = find_mismatches(rows, [(0, 2, 4, 6), (1, 3, 5, 7)], stages_of)
    assert f.stages == (0,) and f.odd_ranks == (4,) and f.what == "optimizer state"
    assert "odd one out by majority: rank 4 (replica 2)" in f.text(12, {0: 0, 2: 1, 4: 2, 6: 3})
    # dp 3: the minority of one; parameters and optimizer state both named
    (f,) = find_mismatches([good, [6, 8], good], [(0, 1, 2)], {0: (0,), 1: (0,), 2: (0,)})
    assert f.odd_ranks == (1,) and f.what == "parameters and optimizer state"
    # dp 2: no majority, both named, no blame
    (f,) = find_mismatches([good, bad], [(0, 1)], {0: (0,), 1: (0,)})
    assert f.odd_ranks == (0, 1) and "cannot tell which one" in f.text(3, {0: 0, 1: 1})
    # dp 4 split 2:2: no majority either
    (f,) = find_mismatches([good, good, bad, bad], [(0, 1, 2, 3)], {r: (0,) for r in range(4)})
    assert f.odd_ranks == (0, 1, 2, 3)


def test_flip_bit_flips_one_bit_once_and_refuses_what_it_cannot_do():
    assert faults.parse_flip_bit("2:7") == faults.BitFlip(2, 7, None)
    assert faults.parse_flip_bit("0:3:layers.0.weight") == faults.BitFlip(0, 3, "layers.0.weight")
    for bad in ("x", "1", "1:-2", "a:b"):
        with pytest.raises(ValueError, match="RANK:STEP"):
            faults.parse_flip_bit(bad)
    w = torch.nn.Parameter(torch.randn(3, 4))
    before = w.detach().clone()
    hook = faults.flip_hook([faults.BitFlip(0, 2, "w")], 0, {"w": w})
    hook(1)
    assert torch.equal(w.detach(), before)
    hook(2)
    diff = (w.detach().view(torch.int32) ^ before.view(torch.int32)).view(-1)
    assert int(diff[0]) == 1 << 20 and not diff[1:].any()
    hook(2)  # a rollback re-runs step 2: no second flip
    assert int((w.detach().view(torch.int32) ^ before.view(torch.int32)).view(-1)[0]) == 1 << 20
    assert faults.flip_hook([faults.BitFlip(1, 2)], 0, {"w": w}) is None  # another rank's
    with pytest.raises(ValueError, match="holds no parameter 'nope'"):
        faults.flip_hook([faults.BitFlip(0, 2, "nope")], 0, {"w": w})


def test_the_check_is_priced_per_step_by_the_cost_model():
    from types import SimpleNamespace as NS

    from partitioner.solver.sdc_cost import DIGEST_BYTES_PER_S, replica_check_s, replica_check_s_per_step

    mem = lambda p, o: NS(params_bytes=p, optimizer_bytes=o)  # noqa: E731
    stages = [NS(memory=mem(1e8, 2e8), device="cpu"), NS(memory=mem(4e8, 8e8), device="cpu")]
    plan = NS(dp=2, world_size=4, stages=stages)
    one = replica_check_s([3e8, 12e8], ["cpu", "cpu"], world_size=4, latency_s=1e-4)
    assert one == 12e8 / DIGEST_BYTES_PER_S["cpu"] + 3 * 1e-4  # the stage with the most state, then the gather
    assert replica_check_s_per_step(plan, 20, latency_s=1e-4) == pytest.approx(one / 20)
    assert replica_check_s_per_step(plan, 0) == 0.0  # off
    assert replica_check_s_per_step(NS(dp=1, world_size=2, stages=stages), 20) == 0.0  # nothing to compare
