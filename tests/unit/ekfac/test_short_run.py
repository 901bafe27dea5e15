"""EK-FAC on a short run (`kfac_stream.ekfac.schedule`): a run no longer than
``snapshot_every`` takes an extra snapshot midway, and its final snapshot stores the correction
measured in that snapshot's basis (against the autograd reference of tests/unit/ekfac/
test_ekfac.py); a schedule that still leaves the final snapshot without one says so at train
begin, and ``eigenvalues="auto"`` says (once) that it falls back to K-FAC's eigenvalues.

The reference for the schedule is a step-by-step replay of the tracker's protocol (update
steps at the 0-based step indices ``b % update_every == 0``, a snapshot at the end of every
``snapshot_every``-th step and of the last, a snapshot's eigenbasis in use from the next step
on, as with ``background_snapshots=False``), and real runs check it.
"""

from __future__ import annotations

import logging
import re

import pytest
import torch

from kfac_stream import Influence, LaplacePosterior, Snapshot
from kfac_stream.ekfac import basis_snapshot_step, final_correction_gap, schedule_advice

from harness import run
from models import text_examples, tiny_gpt2


def _final_has_correction(steps: int, snapshot_every: int, update_every: int) -> bool:
    """Replay the protocol step by step: does the final snapshot get a correction? (The
    snapshots: every ``snapshot_every``-th step and the extra one of `basis_snapshot_step`.)"""
    extra = basis_snapshot_step(steps, snapshot_every, update_every)
    basis = pending = False
    window = False
    for b in range(steps):
        if pending:  # a snapshot's basis goes into use at the next step's begin
            basis, pending = True, False
        if b % update_every == 0 and basis:
            window = True
        done = b + 1  # the global step this optimizer step ends at
        if done == steps:
            return window
        if done % snapshot_every == 0 or done == extra:
            window, pending = False, True
    return False


def test_the_schedule_equals_a_step_by_step_replay():
    for steps in range(1, 30):
        for every in range(1, 12):
            for update in range(1, 7):
                want = _final_has_correction(steps, every, update)
                gap = final_correction_gap(steps, every, update)
                assert (gap is None) == want, (steps, every, update, gap)
                extra = basis_snapshot_step(steps, every, update)
                if steps > every:
                    assert extra is None
                elif extra is not None:  # before the end, an update step at or after it
                    assert 1 <= extra < steps and want
                else:  # its only update step is the first
                    assert update >= steps and not want
            advice = schedule_advice(steps, update)
            found = re.search(r"snapshot_every=(\d+)", advice)
            if found:  # the advice's schedule gives one
                assert _final_has_correction(steps, int(found.group(1)), update), advice
            else:  # none at most half the run does
                assert not any(_final_has_correction(steps, s, update)
                               for s in range(1, max(steps // 2, 1) + 1)), advice
    assert final_correction_gap(0, 5, 1) is None  # the run's length unknown: nothing said


@pytest.mark.parametrize("steps,every,update", [(6, 4, 3), (6, 4, 2), (3, 5, 1), (3, 5, 3)])
def test_real_runs_match_the_schedule(tmp_path, caplog, steps, every, update):
    """The final snapshot of a run carries a correction exactly when the schedule says, and
    the train-begin warning appears exactly when it does not."""
    with caplog.at_level(logging.WARNING, logger="kfac_stream"):
        cb, _, _ = run(tiny_gpt2(), text_examples(2 * steps, 12),
                       {"snapshot_every": every, "update_every": update, "ekfac": True},
                       batch=2, tmp_path=tmp_path, record=False,
                       callback_kwargs={"background_snapshots": False})
    final = Snapshot.load(cb.snapshots[-1])
    assert final.step == steps
    want = final_correction_gap(steps, every, update) is None
    assert want == _final_has_correction(steps, every, update)
    assert all((final[n].ekfac_eigvals is not None) == want for n in final.layer_names)
    said = [r.getMessage() for r in caplog.records
            if "will end without an EK-FAC correction" in r.getMessage()]
    assert len(said) == (0 if want else 1)


def test_a_short_run_stores_the_correction_of_its_extra_snapshot(tmp_path, caplog):
    """``max_steps`` 4 below ``snapshot_every`` 10, lr 0, the exact configuration: the extra
    snapshot at step 2 and the final one at 4, whose correction is the autograd reference's
    mean of the squared rotated per-sequence gradients of update steps 2 and 3 in step 2's
    eigenbasis; background snapshots (the default) wait for the extra one."""
    from test_ekfac import EXACT_TOL, LENGTHS, _brute_force, _rel

    from harness import hf_like_loss

    model = tiny_gpt2()
    with caplog.at_level(logging.INFO, logger="kfac_stream"):
        cb, recs, _ = run(model, text_examples(8, 12, lengths=LENGTHS + LENGTHS[:2]),
                          {"snapshot_every": 10, "ekfac": True}, batch=2, lr=0.0,
                          loss=hf_like_loss, tmp_path=tmp_path, record=True)
    said = [r.getMessage() for r in caplog.records if "an extra snapshot at step 2" in
            r.getMessage()]
    assert len(said) == 1
    batches = [r["kwargs"] for r in recs]
    assert len(batches) == 4
    extra, final = (Snapshot.load(p) for p in cb.snapshots)
    assert (extra.step, final.step) == (2, 4)
    names = final.layer_names
    want = _brute_force(model, names, extra, batches[2:4])
    worst = 0.0
    for n in names:
        entry = final[n].entry.ekfac
        assert (entry.basis_step, entry.first_step, entry.last_step, entry.updates) == \
            (2, 2, 3, 2)
        worst = max(worst, _rel(final[n].ekfac_eigvals, want[n]))
    print(f"short run's EK-FAC correction vs autograd reference: max rel err {worst:.2e}")
    assert worst <= EXACT_TOL


def test_a_run_left_without_says_so_and_auto_warns_once(tmp_path, caplog):
    """``max_steps`` 3 below ``snapshot_every`` 5 with ``update_every`` 3: the only update
    step is the first, so no snapshot's basis can be measured in; the train-begin warning
    names the reason and the fix, ``"auto"`` scores equal ``"kfac"``'s and warn once per
    snapshot."""
    from test_influence import _stack

    model = tiny_gpt2()
    with caplog.at_level(logging.WARNING, logger="kfac_stream"):
        cb, _, _ = run(model, text_examples(6, 12),
                       {"snapshot_every": 5, "update_every": 3, "ekfac": True},
                       batch=2, tmp_path=tmp_path, record=False)
    said = [r.getMessage() for r in caplog.records
            if "will end without an EK-FAC correction" in r.getMessage()]
    assert len(said) == 1
    assert "the run's 3 steps end at or before its first snapshot (snapshot_every=5)" in said[0]
    assert "lower update_every (now 3)" in said[0]
    assert len(cb.snapshots) == 1
    snap = Snapshot.load(cb.snapshots[0])
    assert all(snap[n].ekfac_eigvals is None for n in snap.layer_names)
    model.eval()
    post = LaplacePosterior(model, snap, 2.0)
    queries = _stack(text_examples(2, 10, seed=5))
    train = [_stack(text_examples(3, 12, seed=7))]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kfac_stream"):
        auto = Influence(post).scores(queries, train).scores
        again = Influence(post).scores(queries, train).scores
    told = [r.getMessage() for r in caplog.records
            if "carries no EK-FAC correction" in r.getMessage()]
    assert len(told) == 1
    assert "it is the run's first snapshot (step 3, snapshot_every=5)" in told[0]
    assert "lower update_every (now 3)" in told[0]
    kfac = Influence(post, eigenvalues="kfac").scores(queries, train).scores
    assert torch.equal(auto, kfac) and torch.equal(again, kfac)
