"""A tensor group splits the backward transient as it splits the tensors (Note [sharded transients]
in passes/tp_activations.py), counted by hand on the built-in GPT's block.

Per microbatch of b samples, width h, sequence s, fp32 (4 bytes), narrow = b s h 4, wide = b s 4h 4.
The block's largest transient is the GELU's backward: the residual gradient waiting for the
block's end (narrow, whole) + the GELU output's gradient arriving from the row linear (wide) + the
gradient it makes for its input (wide) + its own temporary (wide): narrow + 3 wide, the wide part
split (the MLP's 4h features between the column and the row linear). The largest whole part of
any node's transient is the second residual add's: its output gradient, the two input gradients it
makes and its temporary, 4 narrow. So a member at degree t holds at most
4 narrow + (narrow + 3 wide - 4 narrow) / t, where main held all of narrow + 3 wide on every member.
"""

from __future__ import annotations

from partitioner import analyze
from partitioner.calibrate.priced_problem import build_problem
from partitioner.models.builtin import gpt
from partitioner.solver.tensor_groups import tp_problem
from passes.tp_activations import sharded_transient_bytes

H, S, B = 64, 32, 2


def test_a_tensor_group_holds_the_split_part_of_the_backward_transient_once():
    gm, _ = analyze(gpt(layers=1, width=H, heads=4, vocab=128, seq=S, attn="eager", dropout=0.0, batch=B))
    narrow, wide = B * S * H * 4, B * S * 4 * H * 4
    block = 1  # regions: embed, block.0, head
    assert sharded_transient_bytes(gm)[block] == (narrow + 3 * wide) - 4 * narrow
    problem = build_problem(gm, B)
    region = problem.regions[block]
    assert region.transient_bytes_per_sample * B == narrow + 3 * wide
    for t in (2, 4):
        group = tp_problem(problem, t).regions[block]
        per_member = group.transient_bytes_per_sample * B / t
        assert per_member == 4 * narrow + (narrow + 3 * wide - 4 * narrow) / t
        assert per_member < region.transient_bytes_per_sample * B  # main: all of it on every member
