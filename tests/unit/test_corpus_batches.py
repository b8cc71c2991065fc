"""Batches of a token corpus (runtime/data/corpus/batches.py, Note [global sample order]): any split of
a step's rows over ranks reassembles make_batch's batch, a resumed run reads what the
uninterrupted one did, every window appears once per epoch, and a rank reads only its bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.data.corpus import CorpusError, CorpusSpec, num_windows, open_source
from runtime.data.corpus.batches import forget_sources, make_batch, rows, source_for

SEQ, GLOBAL_BATCH = 16, 8


@pytest.fixture
def corpus(tmp_path):
    # token t at position t (mod 65521): a window's first token says which window it is
    tokens = (np.arange(40 * SEQ + 1) % 65521).astype(np.uint16)
    tokens.tofile(tmp_path / "train.bin")
    forget_sources()
    yield f"tokens:{tmp_path}/train.bin,dtype=uint16"
    forget_sources()


def _replica_rows(replicas: int, replica: int) -> range:
    share = GLOBAL_BATCH // replicas
    return range(replica * share, (replica + 1) * share)


def test_every_layout_reassembles_the_global_batch(corpus):
    for step in range(6):
        (whole,), targets = make_batch(step, GLOBAL_BATCH, source=corpus, seq=SEQ, seed=3)
        assert whole.shape == targets.shape == (GLOBAL_BATCH, SEQ) and whole.dtype == torch.int64
        assert (whole[:, 1:] == targets[:, :-1]).all()
        for replicas in (1, 2, 4):
            inputs = [rows(step, GLOBAL_BATCH, source=corpus, seq=SEQ, seed=3, rows=_replica_rows(replicas, r),
                           want="inputs")[0][0] for r in range(replicas)]
            last = [rows(step, GLOBAL_BATCH, source=corpus, seq=SEQ, seed=3, rows=_replica_rows(replicas, r),
                         want="targets")[1] for r in range(replicas)]
            assert torch.equal(torch.cat(inputs), whole) and torch.equal(torch.cat(last), targets)
        (sliced,), _ = rows(step, GLOBAL_BATCH, source=corpus, seq=SEQ, seed=3, rows=slice(2, 5))
        assert torch.equal(sliced, whole[2:5])
    other_seed = make_batch(0, GLOBAL_BATCH, source=corpus, seq=SEQ, seed=4)[0][0]
    assert not torch.equal(other_seed, make_batch(0, GLOBAL_BATCH, source=corpus, seq=SEQ, seed=3)[0][0])


def test_a_resumed_run_reads_the_uninterrupted_runs_batches(corpus):
    uninterrupted = [make_batch(s, GLOBAL_BATCH, source=corpus, seq=SEQ, seed=1) for s in range(12)]
    forget_sources()  # a fresh process: nothing cached but what the spec names
    from runtime.data.corpus import windows  # lazy: reaches into the permutation cache to empty it

    windows._permutations.clear()
    resumed = [make_batch(s, GLOBAL_BATCH, source=corpus, seq=SEQ, seed=1) for s in range(7, 12)]
    for got, want in zip(resumed, uninterrupted[7:]):
        assert torch.equal(got[0][0], want[0][0]) and torch.equal(got[1], want[1])


def test_epochs_wrap_and_each_window_appears_once_per_epoch(corpus):
    windows = num_windows(40 * SEQ + 1, SEQ)
    assert windows == 40
    steps = 3 * windows // GLOBAL_BATCH  # three epochs exactly (40 = 5 steps of 8)
    seen = torch.cat([make_batch(s, GLOBAL_BATCH, source=corpus, seq=SEQ)[0][0][:, 0] for s in range(steps)])
    per_epoch = (seen // SEQ).reshape(3, windows)
    for epoch in per_epoch:
        assert sorted(epoch.tolist()) == list(range(windows))
    assert not torch.equal(per_epoch[0], per_epoch[1])  # a new order each epoch


def test_an_epoch_boundary_inside_a_batch(tmp_path):
    np.arange(12 * 4 + 1, dtype=np.uint16).tofile(tmp_path / "t.bin")  # 12 windows of seq 4, batch 8
    spec = f"tokens:{tmp_path}/t.bin,dtype=uint16"
    first = torch.cat([make_batch(s, 8, source=spec, seq=4)[0][0][:, 0] for s in range(3)]) // 4  # 24 samples
    assert sorted(first[:12].tolist()) == list(range(12)) and sorted(first[12:].tolist()) == list(range(12))


def test_what_each_rank_reads(corpus):
    source = source_for(corpus)
    assert source is source_for(CorpusSpec.parse(corpus))  # opened once per process
    cases = [("both", range(GLOBAL_BATCH), GLOBAL_BATCH * (SEQ + 1) * 2),
             ("inputs", range(0, 4), 4 * SEQ * 2),  # stage 0 of replica 0 of 2: its rows, inputs only
             ("targets", range(4, 8), 4 * SEQ * 2),  # the last stage of replica 1
             (None, range(0, 4), 0),  # a middle stage
             ("both", range(0), 0)]
    for want, picked, expected_bytes in cases:
        source.stats.reset()
        inputs, targets = rows(5, GLOBAL_BATCH, source=corpus, seq=SEQ, rows=picked, want=want)
        assert source.stats.bytes_read == expected_bytes, (want, picked)
        assert (inputs is None) == (want in ("targets", None) or not len(picked))
        assert (targets is None) == (want in ("inputs", None) or not len(picked))


def test_rows_refuses_what_it_cannot_serve(corpus):
    with pytest.raises(CorpusError, match="fall outside the global batch of 8"):
        rows(0, GLOBAL_BATCH, source=corpus, seq=SEQ, rows=range(6, 10))
    with pytest.raises(CorpusError, match="want='labels'"):
        rows(0, GLOBAL_BATCH, source=corpus, seq=SEQ, rows=range(2), want="labels")
    with pytest.raises(CorpusError, match=r"needs 6401 tokens\): use a longer corpus"):
        make_batch(0, 400, source=corpus, seq=SEQ)


def test_make_batch_binds_through_resolve_callable(corpus):
    from runtime.program.user_code import resolve_callable  # lazy: the program's binding, tested here only

    bound = resolve_callable(["runtime.data.corpus.batches:make_batch", {"source": corpus, "seq": SEQ}])
    (x,), y = bound(2, GLOBAL_BATCH)
    (want_x,), want_y = make_batch(2, GLOBAL_BATCH, source=corpus, seq=SEQ)
    assert torch.equal(x, want_x) and torch.equal(y, want_y)
    assert open_source(CorpusSpec.parse(corpus)).stats.bytes_read == 0  # a separate object: its own counter
