"""Which window of a split each sample of a run reads: causal-LM windows, their order per epoch.

Window ``w`` of a split is ``tokens[w*seq : w*seq + seq + 1]`` (inputs its first ``seq``, targets
its last ``seq``): non-overlapping, stride ``seq``, so a split of N tokens has (N - 1) // seq.

Note [global sample order]: sample ``i`` of step ``t`` is the run's global sample
``g = t * global_batch + i``; it reads window ``perm_e[g % W]`` of epoch ``e = g // W`` (W
windows), where ``perm_e`` is a permutation seeded by (seed, e) alone. So the sample is a pure
function of (seed, step, i, global_batch, W), never of the layout: whichever rank reads row i
(tp, pp, dp of any degree) reads the same window, and a run resumed at step k on another layout
continues on exactly the samples the uninterrupted run would have read. Every window appears
once per epoch; an epoch boundary may fall inside a batch.

Note [permutation per epoch]: ``perm_e`` is ``numpy.random.Generator(PCG64(SeedSequence((seed,
e)))).permutation(W)`` in int64, computed once per epoch and cached (the newest two: a batch
spans at most two epochs when W >= global_batch). Memory is 8 bytes a window, ~800 MB at 1e8
windows (1e10 tokens at seq 100); beyond that a stateless bijection (a Feistel network over the
window index) would be the next step. numpy documents PCG64's stream as stable, but not
``permutation``'s algorithm across major versions: a resume expects the numpy of the first run's
major version (the pinned constraints.txt holds it).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

_CACHED_PERMUTATIONS = 2
_permutations: OrderedDict[tuple[int, int, int], np.ndarray] = OrderedDict()


def num_windows(num_tokens: int, seq: int) -> int:
    return max(0, (num_tokens - 1) // seq)


def epoch_permutation(seed: int, epoch: int, windows: int) -> np.ndarray:
    """Note [permutation per epoch]."""
    key = (seed, epoch, windows)
    perm = _permutations.get(key)
    if perm is None:
        generator = np.random.Generator(np.random.PCG64(np.random.SeedSequence((seed, epoch))))
        perm = generator.permutation(np.int64(windows)).astype(np.int64, copy=False)
        _permutations[key] = perm
        while len(_permutations) > _CACHED_PERMUTATIONS:
            _permutations.popitem(last=False)
    else:
        _permutations.move_to_end(key)
    return perm


def sample_windows(seed: int, windows: int, samples: np.ndarray) -> np.ndarray:
    """The window index of each global sample number in ``samples`` (Note [global sample order])."""
    samples = np.asarray(samples, dtype=np.int64)
    epochs, positions = np.divmod(samples, windows)
    out = np.empty_like(samples)
    for epoch in np.unique(epochs):
        where = epochs == epoch
        out[where] = epoch_permutation(seed, int(epoch), windows)[positions[where]]
    return out
