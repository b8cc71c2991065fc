"""verify's oracle computes with the ranks' thread count (Note [the oracle computes as the ranks do]
in runtime/execute/reference.py): a torchvision-style ResNet-18 with tiny channels
(tests/own_model/tiny_resnet.py: BasicBlocks with BatchNorm, strided convs, a downsample path,
adaptive pooling), compiled from its file at 2 stages, PASSes `partitioner verify` in a process
whose torch computes with 2 threads while the ranks compute with one. With the oracle at the
caller's 2 threads it FAILed: its BatchNorm over two values per channel at 1x1 pixels and Adam
amplify the other summation order of the convolutions' weight gradients step after step (loss
4e-4 apart after 6 steps at lr 1e-2, bound 1e-5)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import torch

OWN = Path(__file__).resolve().parent.parent / "own_model"


def test_tiny_resnet18_verifies_at_2_stages_with_more_threads_than_the_ranks(tmp_path, monkeypatch):
    from partitioner.cli.verify import verify

    shutil.copy(OWN / "tiny_resnet.py", tmp_path / "tiny_resnet.py")
    done = subprocess.run([sys.executable, "-m", "partitioner", "compile", "tiny_resnet.py:build", "-o", "out",
                           "--devices", "2", "--stages", "2", "--global-batch", "8", "--lr", "0.01", "-q"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the ranks: run_env's one thread
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # this process: more threads than the ranks, as torch's default on 2+ cores
    try:
        report = verify(tmp_path / "out", steps=6, timeout_s=300)
        assert torch.get_num_threads() == 2  # the oracle's one thread was for its run only
    finally:
        torch.set_num_threads(before)
    assert report.ok, report.text()
    # the same kernels on both sides: nothing but the order of the microbatch sums differs
    assert report.max_loss_diff < 1e-6 and report.max_buffer_diff < 1e-6, report.text()
