"""The update step's host work, counted: the torch ops an update step adds to a plain
training step on TinyLlama's 22-layer structure (154 tracked layers, 242 factors), every
thread (`benchmarks/worker_ops.py`; the worker inline, empirical Fisher, ``update_every=1``,
the device path on the CPU). Each op is host time on a GPU (dispatch and a launch, ~5-10 µs)
whatever its size, so a count that grows with the number of factors is the update step's cost
there. Counted at the dispatcher, views included: upper bounds of the profiler's figures."""

import sys

from repo_paths import BENCHMARKS

sys.path.insert(0, str(BENCHMARKS))

from worker_ops import LAYERS, count_update_ops  # noqa: E402

#: per update step, all threads; the worker's fold alone
ADDED_OPS, WORKER_OPS = 800, 150


def test_an_update_step_adds_a_few_hundred_ops_to_a_plain_step():
    r = count_update_ops(LAYERS, "empirical", steps=5)
    by = r["added_by_phase"]
    assert r["added"] <= ADDED_OPS, r
    assert max(r["worker_per_update"]) <= WORKER_OPS, r
    # the capture hooks: one gather per layer call (88 inputs, 154 output gradients, the
    # logits), plus the step's sampling, the positions that carry the loss (~10 ops a pass:
    # `stats.rows.gradient_positions`) and the loss-scale fit
    assert by["step"] <= 244 + 130, by
