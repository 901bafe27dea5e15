"""``KFACConfig.final_window`` (issue 16): over the last share of the training steps the factors
are the exact token-weighted mean of the updates (the EMA restarts), so the last snapshot holds
the curvature near the trained weights. Checked against the brute-force float64 factors of the
window's forwards (`reference.reference_factors`), with the restart step from the plan's
arithmetic, recorded in the counters and the manifest."""

import pytest
import torch

from kfac_stream import KFACConfig, KFACConfigError, Snapshot
from kfac_stream.factor_updates import Counters, FactorUpdater

from harness import factor_errors, run, sum_nll_loss
from models import text_examples, tiny_gpt2
from reference import reference_factors

ORACLE_TOL = 1e-10  # float64 end to end: only summation-order rounding differs
LAYERS = [f"transformer.h.{i}.{m}" for i in range(2)
          for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]


@pytest.mark.parametrize("max_steps,every,window,restart", [
    (100, 10, 0.1, 90),   # 90 is an update step
    (95, 10, 0.1, 90),    # the window starts at ceil(85.5) = 86: the next update step is 90
    (97, 10, 0.1, 90),    # ceil(87.3) = 88 -> 90
    (4, 1, 0.5, 2),
    (4, 10, 0.1, 0),      # no update step in the window: the last one (step 0)
    (25, 10, 0.1, 20),    # ceil(22.5) = 23 -> 30 is past the end: the last update step, 20
    (100, 10, 0.0, None),  # no window
    (0, 10, 0.1, None),   # max_steps unknown
])
def test_restart_step_arithmetic(max_steps, every, window, restart):
    cfg = KFACConfig(update_every=every, final_window=window)
    up = FactorUpdater.__new__(FactorUpdater)  # only the planning state
    up.config, up.counters = cfg, Counters()
    assert up.set_final_window(max_steps) == restart
    if restart is not None:
        assert up.decay_at(restart - 1) is None and up.decay_at(restart) == 0.0
        up.counters.window_start_step = restart
        assert up.decay_at(restart + every) == 1.0


def test_final_window_factors_are_the_mean_over_the_window(tmp_path):
    """8 examples, batch 2: 4 steps, one update each, ``ema_decay=0.5``: with
    ``final_window=0.5`` the window starts at step 2 and the factors equal the brute-force
    token-weighted factors of steps 2 and 3 only; the plain EMA (``final_window=0``) differs
    from that mean by far more than the tolerance (the test can fail)."""
    examples = text_examples(8, 12, lengths=[12, 9, 12, 7, 12, 12, 10, 12])
    model = tiny_gpt2(torch.float64)
    cb, records, _ = run(model, examples, {"ema_decay": 0.5, "final_window": 0.5,
                                            "min_window_sequences": 0, "snapshot_every": 3},
                         batch=2,
                         loss=sum_nll_loss, tmp_path=tmp_path / "window")
    assert len(records) == 4 and cb.tracker.counters.window_start_step == 2
    ref, _ = reference_factors(model, records[2:], LAYERS)
    errs = factor_errors(cb, ref)
    assert max(errs.values()) <= ORACLE_TOL, errs
    snaps = {Snapshot.load(p).step: Snapshot.load(p) for p in cb.snapshots}
    assert snaps[3].meta["counts"]["window_start_step"] == 2
    assert snaps[4].meta["counts"]["window_start_step"] == 2
    assert snaps[4].meta["config"]["final_window"] == 0.5

    ema_model = tiny_gpt2(torch.float64)
    ema_cb, _, _ = run(ema_model, examples, {"ema_decay": 0.5, "final_window": 0.0}, batch=2,
                       loss=sum_nll_loss, tmp_path=tmp_path / "ema", record=False)
    assert ema_cb.tracker.counters.window_start_step == -1
    assert max(factor_errors(ema_cb, ref).values()) > 1e-3


@pytest.mark.parametrize("bad", [-0.1, 1.0, float("nan"), "0.1", True])
def test_final_window_range(bad):
    with pytest.raises(KFACConfigError, match=r"^KFACConfig.final_window="):
        KFACConfig(final_window=bad)


@pytest.mark.parametrize("restored,max_steps,kept", [
    (1, 4, -1),  # a window of a shorter plan (max_steps 2: restart at 1) before this one's (3)
    (3, 4, 3),   # resumed inside this plan's window
    (2, 0, -1),  # max_steps unknown now: no window
])
def test_window_restored_from_another_plan_is_dropped(restored, max_steps, kept):
    """A checkpoint's window start counts only within this run's plan: resumed with another
    ``max_steps``, the restart at this plan's step discards the state before it, as an
    uninterrupted run of this plan does (`tests/test_distributed.py` resumes a 2-step run to
    4 steps and compares bit for bit)."""
    up = FactorUpdater.__new__(FactorUpdater)
    up.config, up.counters = KFACConfig(update_every=1, final_window=0.1), Counters()
    up.counters.window_start_step = restored
    up.set_final_window(max_steps)
    assert up.counters.window_start_step == kept


def test_ema_decay_one_is_the_mean_over_the_whole_run(tmp_path, caplog):
    """``ema_decay=1.0`` asks for the exact running mean over every update. With the default
    ``final_window`` (0.1) a 4-step run would restart the average at its last update (step 3)
    and hold that step alone; instead the window is off, the factors are the brute-force mean
    of all four steps, and the tracker says so at train begin."""
    cfg = KFACConfig(ema_decay=1.0)
    assert cfg.final_window == 0.1  # the default, not set by the user
    up = FactorUpdater.__new__(FactorUpdater)
    up.config, up.counters = cfg, Counters()
    assert up.set_final_window(100) is None and up.window_plan is None
    examples = text_examples(8, 12, lengths=[12, 9, 12, 7, 12, 12, 10, 12])
    model = tiny_gpt2(torch.float64)
    with caplog.at_level("INFO", logger="kfac_stream"):
        cb, records, _ = run(model, examples, {"ema_decay": 1.0, "final_window": 0.1},
                             batch=2, loss=sum_nll_loss, tmp_path=tmp_path)
    assert len(records) == 4 and cb.tracker.counters.window_start_step == -1
    ref, _ = reference_factors(model, records, LAYERS)
    errs = factor_errors(cb, ref)
    assert max(errs.values()) <= ORACLE_TOL, errs
    last, _ = reference_factors(model, records[3:], LAYERS)  # what the window would hold
    assert max(factor_errors(cb, last).values()) > 1e-3
    assert "ema_decay=1 is the mean over every update of the run: final_window=0.1 is off" \
        in caplog.text
