"""``KFACConfig.final_window``: over the last share of the training steps the factors
are the exact token-weighted mean of the updates (the EMA restarts), so the last snapshot holds
the curvature near the trained weights. Checked against the brute-force float64 factors of the
window's forwards (`reference.reference_factors`), with the restart step from the plan's
arithmetic, recorded in the counters and the manifest."""

import math
from dataclasses import replace

import pytest
import torch
from transformers import Trainer, TrainingArguments

from kfac_stream import KFACConfig, KFACConfigError, KFACStreamCallback, Snapshot
from kfac_stream.config import mc_full_batch
from kfac_stream.fisher.replay_draws import replay_counts
from kfac_stream.snapshot.adequacy import sampling_problems, sampling_summary
from kfac_stream.tracking.factor_updates import Counters, FactorUpdater
from kfac_stream.tracking.plan import (
    plan_window,
    sequences_per_update,
    update_sequences,
    window_mc_share,
)

from harness import factor_errors, run, sum_nll_loss
from models import ListDataset, text_examples, tiny_gpt2
from reference import reference_factors

ORACLE_TOL = 1e-10  # float64 end to end: only summation-order rounding differs
LAYERS = [f"transformer.h.{i}.{m}" for i in range(2)
          for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]

def _use_window(up, max_steps, sequences_per_update=0, sequences_at=None):
    """The updater's window as the run plan plans it (`plan_window`); the restart step."""
    return up.set_final_window(plan_window(up.config, max_steps, sequences_per_update,
                                           sequences_at))



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
    assert _use_window(up, max_steps) == restart
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
    assert snaps[3].manifest.counts.window_start_step == 2
    assert snaps[4].manifest.counts.window_start_step == 2
    assert snaps[4].manifest.config["final_window"] == 0.5

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
    uninterrupted run of this plan does (`tests/runs/test_distributed.py` resumes a 2-step run to
    4 steps and compares bit for bit)."""
    up = FactorUpdater.__new__(FactorUpdater)
    up.config, up.counters = KFACConfig(update_every=1, final_window=0.1), Counters()
    up.counters.window_start_step = restored
    _use_window(up, max_steps)
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
    assert _use_window(up, 100) is None and up.window_plan is None
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


# -- the raised MC share's window reaches min_window_sequences ----------------------------------

def _planned(cfg, batch, acc, world, max_steps):
    """What the callback plans at train begin: the run's share (`window_mc_share`, as
    `RunPlan.resolve` applies it) and its final window, each update step's draw counted."""
    share = window_mc_share(cfg, batch, acc, world, max_steps)
    run_cfg = cfg if share is None else replace(cfg, mc_sequences=share)
    up = FactorUpdater.__new__(FactorUpdater)
    up.config, up.counters = run_cfg, Counters()
    _use_window(up, max_steps, sequences_per_update(run_cfg, batch, acc, world),
                        update_sequences(run_cfg, batch, acc, world))
    return run_cfg, up.window_plan


def _replayed(cfg, batch, acc, world, steps):
    """Sequences the MC replay runs on over ``steps``, from the tracker's own draw
    (`replay_counts`, the same on every rank) of full micro-batches: every one for "all"."""
    f = cfg.mc_sequences
    if mc_full_batch(f):
        return len(steps) * batch * acc * world
    return sum(world * sum(replay_counts(f, [batch] * acc, cfg.seed, s, at_least_one=s == 0)[0])
               for s in steps)


def test_unrounded_share_plans_too_short_a_window():
    """Why a window meant to hold 256 sequences held 240: 600 steps at batch 8, update_every
    10: 60 update steps offer 480 sequences; the share was raised to 256/480, which draws 4 or
    5 of a step's 8 (systematic sampling of 4.27), but the plan counted round(4.27) = 4 a step,
    240 in all, and the draws themselves reach 256 only on average (253 with seed 3)."""
    old = KFACConfig(mc_sequences=256 / 480)
    assert sequences_per_update(old, 8, 1, 1) * 60 == 240
    totals = [_replayed(replace(old, seed=s), 8, 1, 1, range(0, 600, 10)) for s in range(5)]
    assert totals == [258, 257, 256, 253, 262]


@pytest.mark.parametrize("batch,acc,world,max_steps,seed,share", [
    (8, 1, 1, 600, 0, 5 / 8),      # that run: 480 offered; 5 of 8 a step: 52 updates, 260
    (8, 1, 1, 320, 0, 1.0),        # offered exactly 256: every sequence
    (8, 1, 1, 330, 0, 1.0),        # 264 offered: ⌈256/33⌉ = 8 a step, the window 32 updates
    (8, 1, 1, 370, 0, 7 / 8),      # 296 offered: 7 a step, 37 updates, 259
    (8, 1, 1, 300, 0, 1.0),        # 240 offered, fewer than 256: all of them
    (30, 1, 1, 400, 0, 7 / 30),    # 1,200 offered: 7 of 30 a step (256/1200 = 6.4 of 30)
    (2, 2, 4, 100, 0, 1.0),        # 4 ranks x 2 micro-batches of 2: 10 x 16 = 160 < 256
    (2, 2, 4, 320, 0, 1 / 2),      # 32 x 16 = 512: 2 of a rank's 4 a step, 32 x 8 = 256
    (1, 4, 8, 1500, 3, 1 / 4),     # 8 ranks: the draws at 0.05 hold 216 < 256: one per rank
    (1, 4, 8, 1500, 0, None),      # the same run, seed 0: the draws at 0.05 hold 264 already
    (8, 1, 1, 64000, 0, None),     # long: 0.05 draws 0 or 1 of 8 a step (not "1" a step)
])
def test_raised_share_reaches_min_window_sequences(batch, acc, world, max_steps, seed, share):
    """The planned window holds ``min_window_sequences`` (256) whenever the run's update
    steps offer as many sequences, and all of them when they offer fewer; its recorded count
    is what the replay draws over the window's steps (`replay_counts`); a raised share replays
    the same whole number of every step's sequences, at most one per rank and step more than
    the minimum's average; the window is no longer than it must be."""
    cfg = KFACConfig(seed=seed)  # share 0.05, update_every 10, final_window 0.1, min 256
    need, every = cfg.min_window_sequences, cfg.update_every
    updates = (max_steps - 1) // every + 1
    offered = updates * batch * acc * world
    run_cfg, plan = _planned(cfg, batch, acc, world, max_steps)
    got = run_cfg.mc_sequences if run_cfg.mc_sequences != cfg.mc_sequences else None
    assert got == (None if share is None else pytest.approx(share, rel=1e-15))
    last = (updates - 1) * every
    steps = range(plan.restart_step, last + 1, every)
    assert plan.sequences == _replayed(run_cfg, batch, acc, world, steps)
    if offered >= need:
        assert plan.sequences >= need, (plan, offered)
        fraction_start = -(-math.ceil(0.9 * max_steps - 1e-9) // every) * every
        if plan.restart_step < fraction_start:  # moved back: one update fewer is too few
            first = _replayed(run_cfg, batch, acc, world, [plan.restart_step])
            assert plan.sequences - first < need
    else:
        assert plan.restart_step == 0 and plan.sequences == offered
    if got is not None and got < 1.0:
        k = got * batch * acc
        assert k == round(k) and _replayed(run_cfg, batch, acc, 1, [every]) == k
        assert got <= need / offered + 1 / (batch * acc)
    if max_steps == 64000:  # 0.4 a step on average: about 640 updates, not 256
        assert 500 < plan.updates < 800


def _count_replays(monkeypatch):
    """``{step: sequences}`` the MC sub-batch replay ran on, recorded as the tracker calls it."""
    import kfac_stream.fisher.mc_subbatch as replay_module

    seen, real = {}, replay_module.mc_subbatch_pass

    def counting(model, capture, inputs, **kwargs):
        step, count = counting.tracker_step(), kwargs["count"]
        seen[step] = seen.get(step, 0) + int(inputs["input_ids"].shape[0] if count is None
                                             else count)
        return real(model, capture, inputs, **kwargs)

    monkeypatch.setattr(replay_module, "mc_subbatch_pass", counting)
    return seen, counting


@pytest.mark.parametrize("batch,steps,need,share,start,held", [
    (8, 60, 256, 5 / 8, 8, 260),  # the short run's numbers: 60 update steps of 8, min 256
    (4, 10, 40, 1.0, 0, 40),      # offered exactly the minimum: every sequence
    (4, 14, 40, 3 / 4, 0, 42),    # 56 offered: 3 of 4 a step, the whole run
])
def test_real_run_window_holds_min_window_sequences(tmp_path, monkeypatch, batch, steps, need,
                                                    share, start, held):
    """A real Trainer run (update_every 1) too short for its window at the share 0.05: the
    snapshot records the raised share and a window of at least ``min_window_sequences``
    sequences, counted here from the replays the tracker ran (the old plan held 240 of 256)."""
    seen, counting = _count_replays(monkeypatch)
    model = tiny_gpt2()
    cfg = {"fisher": "mc", "mc_sequences": 0.05, "update_every": 1, "final_window": 0.1,
           "ema_decay": 0.95, "min_window_sequences": need}
    cb = KFACStreamCallback(KFACConfig(**cfg, output_dir=str(tmp_path / "kfac")))
    counting.tracker_step = lambda: int(cb.tracker.step)
    args = TrainingArguments(str(tmp_path), per_device_train_batch_size=batch, max_steps=steps,
                             learning_rate=1e-3, report_to=[], save_strategy="no",
                             logging_strategy="no", disable_tqdm=True, use_cpu=True, seed=0)
    Trainer(model=model, args=args, train_dataset=ListDataset(text_examples(16, 12)),
            callbacks=[cb]).train()
    snap = Snapshot.load(cb.snapshots[-1])
    counts = snap.manifest.counts
    assert snap.manifest.config["mc_sequences"] == pytest.approx(share, rel=1e-15)
    assert counts.window_start_step == start
    assert counts.window_sequences == held >= need
    s = sampling_summary(snap.manifest)
    assert s["window_sequences"] >= s["min_window_sequences"] == need
    assert not any("fewer than min_window_sequences" in p for p in sampling_problems(snap.manifest))
    if share < 1.0:  # the sub-batch replays: what they ran in the window is what is recorded
        assert sorted(seen) == list(range(steps))
        assert sum(n for step, n in seen.items() if step >= start) == held
