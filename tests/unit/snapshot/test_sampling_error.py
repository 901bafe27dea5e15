"""The final window's sample size and the factors' sampling error (`KFACConfig.
min_window_sequences`, `FactorState.sampling_error`, `kfac_stream.snapshot.adequacy`).

* The window planning arithmetic: moved back by whole updates until it holds enough sequences.
* On a tiny model, an extended window's factors equal the brute-force float64 factors of
  exactly the window's forwards.
* The sampling-error estimate against replication: the spread of many independent runs'
  factors (the estimate is a variance, so it is checked in expectation over replicates).
* On a tiny model with fixed weights, the window mean of the MC Fisher against the EXACT
  expected Fisher, within a few of its own reported standard errors; the reported error
  against the brute-force standard error of the recorded updates.
* The snapshot records it; `LaplacePosterior` and `kfac-stream inspect` warn when the
  posterior rests on too few samples, and stay silent when it does not.
"""

import math
import warnings
from dataclasses import replace

import pytest
import torch
from test_mc_subbatch import _updates

from kfac_stream import HeldoutConfig, KFACConfig, KFACConfigError, LaplacePosterior, Snapshot
from kfac_stream.snapshot import adequacy
from kfac_stream.snapshot.adequacy import REL_SE_WARN, sampling_problems, sampling_summary
from kfac_stream.store.factor_store import FactorStore
from kfac_stream.tracking.factor_updates import Counters, FactorUpdater
from kfac_stream.tracking.plan import plan_window, sequences_per_update, window_mc_share

from harness import ListDataset, brute_heldout_choice, factor_errors, run, sum_nll_loss
from models import text_examples, tiny_gpt2
from reference import expected_fisher_G, reference_factors

ORACLE_TOL = 1e-10  # float64 end to end: only summation-order rounding differs
LAYERS = [f"transformer.h.{i}.{m}" for i in range(2)
          for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]

def _use_window(up, max_steps, sequences_per_update=0, sequences_at=None):
    """The updater's window as the run plan plans it (`plan_window`); the restart step."""
    return up.set_final_window(plan_window(up.config, max_steps, sequences_per_update,
                                           sequences_at))



@pytest.mark.parametrize("max_steps,every,window,seqs,need,restart,updates", [
    (1000, 10, 0.1, 4, 0, 900, 10),     # min_window_sequences 0: the fraction alone
    (1000, 10, 0.1, 0, 256, 900, 10),   # sequences per update unknown: no move
    (1000, 10, 0.1, 4, 40, 900, 10),    # 10 updates × 4 = 40: already enough
    (1000, 10, 0.1, 4, 41, 890, 11),    # one more update needed
    (1000, 10, 0.1, 4, 256, 360, 64),   # 64 updates: steps 360..990
    (400, 10, 0.1, 4, 256, 0, 40),      # the whole run holds 160 < 256: all of it
    (95, 10, 0.1, 8, 24, 70, 3),        # last update step 90; 3 updates: 70, 80, 90
])
def test_window_moves_back_until_it_holds_enough_sequences(max_steps, every, window, seqs,
                                                           need, restart, updates):
    cfg = KFACConfig(update_every=every, final_window=window, min_window_sequences=need)
    up = FactorUpdater.__new__(FactorUpdater)  # only the planning state
    up.config, up.counters = cfg, Counters()
    assert _use_window(up, max_steps, seqs) == restart
    assert up.window_plan.updates == updates
    assert up.window_plan.sequences == updates * seqs


def test_sequences_per_update():
    mc = KFACConfig(mc_sequences=0.125)  # a share of the step's sequences: the expected count
    assert sequences_per_update(mc, 30, 1, 1) == 4  # round(30/8)
    assert sequences_per_update(mc, 1, 4, 8) == 4  # 1/8 of 32 micro-batches of one sequence
    assert sequences_per_update(KFACConfig(), 1, 4, 8) == 2  # default 0.05: round(1.6)
    assert sequences_per_update(KFACConfig(), 1, 1, 1) == 1  # at least one
    assert sequences_per_update(KFACConfig(mc_sequences=1), 1, 4, 8) == 32  # int: per micro-batch
    assert sequences_per_update(KFACConfig(fisher="empirical"), 30, 2, 2) == 120
    assert sequences_per_update(KFACConfig(mc_sequences="all"), 16, 1, 1) == 16


def test_window_mc_share_raises_the_share_only_for_short_runs():
    d = KFACConfig()  # share 0.05, update_every 10, min_window_sequences 256
    # 400 steps at batch 30: 40 update steps offer 1,200 sequences, 60 at 0.05 → 7 of every
    # step's 30 (⌈256/40⌉; 256/1200 would draw 6 or 7 of 30, 256 only on average)
    assert window_mc_share(d, 30, 1, 1, 400) == 7 / 30
    # 600 steps at batch 8: 60 update steps offer 480 → 5 of 8 (256/480 left 240 planned)
    assert window_mc_share(d, 8, 1, 1, 600) == 5 / 8
    # fewer sequences than the minimum in all: every sequence of an update step ("all")
    assert window_mc_share(d, 2, 1, 1, 40) == 1.0
    # enough at 0.05: 7B-like run, 8 ranks × micro-batch 1 × 4 accumulation, 2,000 steps:
    # 200 update steps × 32 = 6,400 sequences, 320 at 0.05 on average; each step draws 0 or
    # 8 (one of a rank's 4 on every rank, or none), and these draws hold 256 at either seed
    assert window_mc_share(d, 1, 4, 8, 2000) is None
    assert window_mc_share(replace(d, seed=3), 1, 4, 8, 2000) is None
    # 1,500 steps: 240 on average; the draws of seed 0 hold 264 (no raise), seed 3's 216:
    # one sequence of every rank's 4 a step
    assert window_mc_share(d, 1, 4, 8, 1500) is None
    assert window_mc_share(replace(d, seed=3), 1, 4, 8, 1500) == 1 / 4
    # nothing to raise: an int or "all", the empirical Fisher, no final window, no minimum
    for cfg in (KFACConfig(mc_sequences=1), KFACConfig(mc_sequences="all"),
                KFACConfig(fisher="empirical"), KFACConfig(final_window=0.0),
                KFACConfig(min_window_sequences=0), KFACConfig(ema_decay=1.0)):
        assert window_mc_share(cfg, 30, 1, 1, 400) is None
    assert window_mc_share(d, 30, 1, 1, 0) is None  # max_steps unknown


def test_short_run_raises_the_mc_share_to_fill_its_window(tmp_path):
    """A real Trainer run too short for its final window at the default share: the share is
    raised (recorded in the snapshot's config) and the window holds min_window_sequences."""
    model = tiny_gpt2()
    # 40 steps at batch 4, update_every 2: 20 update steps offer 80 sequences; 0.05 gives 4
    cb, _, _ = run(model, text_examples(16, 12), {"fisher": "mc", "update_every": 2,
                                                   "final_window": 0.1, "ema_decay": 0.95,
                                                   "min_window_sequences": 40},
                   batch=4, steps=40, tmp_path=tmp_path, record=False, lr=1e-3)
    snap = Snapshot.load(cb.snapshots[-1])
    assert snap.manifest.config["mc_sequences"] == pytest.approx(0.5)  # 40 / 80
    counts = snap.manifest.counts
    assert counts.sequences_per_update == 2  # 0.5 of 4
    assert counts.window_sequences >= 40
    assert not any("fewer than min_window_sequences" in p for p in sampling_problems(snap.manifest))


@pytest.mark.parametrize("bad", [-1, 1.5, True, "256"])
def test_min_window_sequences_must_be_a_count(bad):
    with pytest.raises(KFACConfigError, match="min_window_sequences"):
        KFACConfig(min_window_sequences=bad)


def test_extended_window_factors_are_the_mean_over_its_updates(tmp_path):
    """8 examples, batch 2, 4 steps, one update each (2 sequences per update): the fraction
    ``final_window=0.25`` alone starts at step 3; ``min_window_sequences=4`` needs two
    updates, so the window starts at step 2, and the factors equal the brute-force factors of
    steps 2 and 3 (not of step 3 alone: checked, so the test can fail)."""
    examples = text_examples(8, 12, lengths=[12, 9, 12, 7, 12, 12, 10, 12])
    model = tiny_gpt2(torch.float64)
    cfg = {"ema_decay": 0.5, "final_window": 0.25, "min_window_sequences": 4,
           "fisher": "empirical"}
    cb, records, _ = run(model, examples, cfg, batch=2, loss=sum_nll_loss,
                         tmp_path=tmp_path / "window")
    assert len(records) == 4 and cb.tracker.counters.window_start_step == 2
    assert cb.tracker.counters.window_sequences == 4
    ref, _ = reference_factors(model, records[2:], LAYERS)
    errs = factor_errors(cb, ref)
    assert max(errs.values()) <= ORACLE_TOL, errs
    last, _ = reference_factors(model, records[3:], LAYERS)
    assert min(factor_errors(cb, last).values()) > 1e3 * ORACLE_TOL
    snap = Snapshot.load(cb.snapshots[-1])
    assert snap.manifest.counts.window_sequences == 4
    assert snap.manifest.counts.sequences_per_update == 2
    for name in LAYERS:  # two updates of unequal weight (padding): (n1+n2)²/(n1²+n2²) ≤ 2
        s = snap.manifest.layers[name].G.sampling
        assert 1.5 < s.effective_updates <= 2.0 + 1e-12


REPLICATES = 400
REP_TOL = 0.15  # the mean of 400 replicates' squared errors: its own relative SE is ~7%


@pytest.mark.parametrize("decay,updates,path", [(1.0, 12, "rows"), (0.8, 30, "rows"),
                                                 (1.0, 6, "stat")])
def test_sampling_error_matches_replicated_runs(decay, updates, path):
    """Each replicate folds ``updates`` statistics of 6 rows drawn from one Gaussian (d = 3,
    unequal weights) into a float64 store; the mean over replicates of the reported
    ``rel_se²`` must equal the replicates' mean ``‖F − E F‖² / ‖E F‖²`` within `REP_TOL`
    (E F = the Gaussian's second moment, exact). Forgetting the 1 − R/w² correction or the
    effective count would miss by ≥ 1/(K_eff − 1) or a factor K_eff."""
    gen = torch.Generator().manual_seed(0)
    chol = torch.tensor([[1.0, 0.0, 0.0], [0.5, 1.0, 0.0], [0.2, -0.3, 0.7]], dtype=torch.float64)
    exact = chol @ chol.T
    est, err = [], []
    for _ in range(REPLICATES):
        store = FactorStore("float64", decay)
        store.add("f", 3, False)
        for k in range(updates):
            m = 4 + (k % 3)
            x = torch.randn(m, 3, generator=gen, dtype=torch.float64) @ chol.T  # [m, 3]
            if path == "rows":
                store.push_rows("f", x, float(m))
            else:
                store.update("f", x.T @ x / m, float(m))
        st = store.state_dict()["f"]
        rel, k_eff = st.sampling_error()
        est.append(rel ** 2)
        err.append(float((st.value() - exact).pow(2).sum() / exact.pow(2).sum()))
    ratio = (sum(est) / REPLICATES) / (sum(err) / REPLICATES)
    print(f"decay {decay}, {updates} updates ({path}): K_eff {k_eff:.2f}, mean rel_se² / "
          f"replicated rel. MSE = {ratio:.3f}")
    assert abs(ratio - 1.0) <= REP_TOL, ratio


def test_window_mean_against_the_exact_expected_fisher(tmp_path):
    """Fixed weights (lr 0), the MC Fisher on 2 of 4 sequences per update, 300 updates, all in
    the window (``min_window_sequences`` ≥ the run's): the window's G is within 4 of its own
    reported standard errors of the exact expected Fisher ``Σ Jᵀ(diag p − ppᵀ)J``, and the
    reported error is within 1.5x of the brute-force standard error of the recorded updates'
    mean (the same updates folded by `_updates` with ``ema_decay=0``). Loose because G's
    spread is measured through 8 fixed Gaussian probes (sides > 32): a sketch whose relative
    error is about sqrt(2/(8·effective rank)), 0.1-0.3 here; an error in the effective count
    (×K) or a missing square root would still fail it."""
    model = tiny_gpt2()
    ex = text_examples(4, 12, lengths=[12, 9, 12, 7])
    K = 300
    cfg = {"fisher": "mc", "mc_sequences": 2, "token_fraction": 0.3, "final_window": 0.1,
           "min_window_sequences": 10**6, "final_refresh": "off"}  # the window's own mean
    # the window: every update, folded as a mean; the tracker restarts at step 0
    cb_w, _ = _updates(model, ex, {**cfg, "ema_decay": 0.95}, K, tmp_path / "w")
    assert cb_w.tracker.counters.window_start_step == 0
    cb_s, stats = _updates(model, ex, {**cfg, "final_window": 0.0}, K, tmp_path / "s")
    batch = {k: torch.stack([e[k] for e in ex]) for k in ex[0]}
    layers = list(cb_w.tracker.specs)
    exact_G = expected_fisher_G(model, batch, layers)
    state = cb_w.tracker.store.state_dict()
    worst_z, worst_ratio = 0.0, 1.0
    for n in layers:
        st = state[cb_w.tracker.plan.g_key(n)]
        rel, k_eff = st.sampling_error()
        assert k_eff == pytest.approx(K, rel=1e-9)  # equal weights: every update counts once
        F = st.value(torch.float64)
        se = rel * float(F.norm())
        draws = torch.stack([s[n][1] for s in stats]).double()  # [K, d, d]
        brute = float(((draws - draws.mean(0)).square().sum() / (K * (K - 1))).sqrt())
        assert float((F - draws.mean(0)).norm()) <= 1e-6 * float(F.norm())  # same updates
        worst_z = max(worst_z, float((F - exact_G[n]).norm()) / se)
        worst_ratio = max(worst_ratio, se / brute, brute / se)
    print(f"max ‖F − exact‖/reported SE {worst_z:.2f} (bound 4); reported vs brute-force SE "
          f"within ×{worst_ratio:.3f} (bound 1.5)")
    assert worst_z <= 4.0
    assert worst_ratio <= 1.5


def _short_run(tmp_path, cfg, steps=4, batch=2):
    model = tiny_gpt2()
    examples = text_examples(8, 12)
    # one sequence of every micro-batch (an earlier default at these batch sizes; the
    # default share 0.05 of 2 sequences would replay on about one update in ten); ema_decay < 1:
    # the harness's exact running mean (ema_decay=1) turns the window off
    cb, _, _ = run(model, examples, {"fisher": "mc", "mc_sequences": 1, "final_window": 0.5,
                                     "ema_decay": 0.95,
                                     **cfg}, batch=batch,
                   steps=steps, tmp_path=tmp_path, record=False, lr=1e-3)
    return model.eval(), Snapshot.load(cb.snapshots[-1])


def test_short_run_warns_at_query_time_and_in_the_report(tmp_path, capsys, caplog):
    import logging

    from kfac_stream.cli import main

    with caplog.at_level(logging.INFO, logger="kfac_stream"):
        model, snap = _short_run(tmp_path / "short", {"min_window_sequences": 256})
    few = [r.getMessage() for r in caplog.records if "few samples" in r.getMessage()]
    assert len(few) == 1 and "said once" in few[0], few  # train begin; not at the snapshot
    s = sampling_summary(snap.manifest)
    assert s["window_sequences"] == 4 * 1  # 4 updates (the whole run) × 1 sequence
    problems = sampling_problems(snap.manifest)
    assert any("fewer than min_window_sequences=256" in p for p in problems), problems
    # said once in training (train begin, above) and once more at query time: the
    # first posterior built on the run's snapshots in this process, none after it; a later
    # process (the CLI's query) is told once too
    for fresh_process in (False, True):
        if fresh_process:
            adequacy._SAID.clear()
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            LaplacePosterior(model, snap)
            LaplacePosterior(model, snap)
        said = [str(w.message) for w in said if "rests on few samples" in str(w.message)]
        assert len(said) == 1 and "It matters for its posterior only" in said[0], said
    assert main(["inspect", snap.path]) == 0
    out = capsys.readouterr().out
    assert "sampling: largest relative standard error" in out and "rests on few samples" in out


def test_few_samples_said_once_per_run_and_once_at_query_time(tmp_path, caplog):
    """The warning once appeared four times in one run; now a short run with four snapshots
    warns once in its log (train begin; no snapshot repeats it, no UserWarning in training);
    every manifest keeps the figures; posteriors built on each snapshot, twice over, say it
    once between them."""
    import logging

    with caplog.at_level(logging.INFO, logger="kfac_stream"), \
            warnings.catch_warnings(record=True) as during:
        warnings.simplefilter("always")
        model, _ = _short_run(tmp_path, {"min_window_sequences": 256, "snapshot_every": 3,
                                         "final_refresh": "off"}, steps=12)
    logged = [r for r in caplog.records if "few samples" in r.getMessage()]
    assert len(logged) == 1 and logged[0].levelno == logging.WARNING, logged
    assert not [w for w in during if "few samples" in str(w.message)]
    snaps = [Snapshot.load(p) for p in sorted((tmp_path / "kfac").glob("step-*")) if p.is_dir()]
    assert [s.step for s in snaps] == [3, 6, 9, 12]
    for snap in snaps:  # not lost: every manifest records the short window
        assert sampling_summary(snap.manifest)["window_sequences"] == 12  # 12 updates × 1
        assert any("fewer than min_window_sequences=256" in p for p in sampling_problems(
            snap.manifest))
    with warnings.catch_warnings(record=True) as queried:
        warnings.simplefilter("always")
        for snap in snaps + snaps:
            LaplacePosterior(model, snap)
    said = [str(w.message) for w in queried if "fewer than min_window_sequences" in
            str(w.message)]
    assert len(said) == 1 and said[0].startswith("LaplacePosterior: the snapshot of step 3 "
                                                 "rests on few samples"), said


def test_enough_samples_give_no_warning(tmp_path):
    # 24 steps: a window of 12 updates × 4 sequences (the whole batch)
    model, snap = _short_run(tmp_path / "ok", {"min_window_sequences": 48, "mc_sequences": 4},
                             steps=24, batch=4)
    s = sampling_summary(snap.manifest)
    assert s["window_sequences"] >= 4
    if s["max_rel_se"] > REL_SE_WARN:  # the second sign alone may still fire: say which
        pytest.fail(f"rel_se {s['max_rel_se']:.3g} > {REL_SE_WARN}: choose a larger run")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        LaplacePosterior(model, snap)
    assert math.isfinite(s["max_rel_se"])


def test_prior_precision_fitted_on_the_eval_dataset(tmp_path):
    """``HeldoutConfig(prior_precision=True)`` on a sequence classifier with an
    ``eval_dataset``: the stored (tau, link) is the candidate with the lowest held-out NLL,
    recomputed here by brute force (`LaplacePosterior.predictive` at every candidate tau, both
    links, per example)."""
    from transformers import GPT2Config, GPT2ForSequenceClassification, Trainer, TrainingArguments

    from kfac_stream import KFACStreamCallback

    torch.manual_seed(0)
    model = GPT2ForSequenceClassification(GPT2Config(
        vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2, num_labels=3,
        pad_token_id=0, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0))
    ids = torch.randint(1, 64, (34, 10), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": i, "attention_mask": torch.ones_like(i),
             "labels": torch.tensor(int(i[0]) % 3)} for i in ids]
    train, held = data[:24], data[24:]
    cb = KFACStreamCallback(KFACConfig(output_dir=str(tmp_path / "kfac")),
                            heldout=HeldoutConfig(prior_precision=True))
    args = TrainingArguments(str(tmp_path), per_device_train_batch_size=4,
                             per_device_eval_batch_size=4, max_steps=6, learning_rate=1e-2,
                             report_to=[], save_strategy="no", logging_strategy="no",
                             disable_tqdm=True, use_cpu=True, seed=0)
    with warnings.catch_warnings(record=True) as during:
        warnings.simplefilter("always")
        Trainer(model=model, args=args, train_dataset=ListDataset(train),
                eval_dataset=ListDataset(held), callbacks=[cb]).train()
    snap = Snapshot.load(cb.snapshots[-1])
    prior = snap.heldout_prior
    assert prior is not None and prior.examples == 10
    model.eval()
    # 6 steps × 4 sequences < min_window_sequences: said at train begin only, not
    # by the tau fit's own posterior; the user's first posterior says it once more
    assert not [w for w in during if "few samples" in str(w.message)]
    with pytest.warns(UserWarning, match="rests on few samples"):
        post = LaplacePosterior(model, snap)
    batch = {k: torch.stack([e[k] for e in held]) for k in ("input_ids", "attention_mask")}
    y = torch.stack([e["labels"] for e in held])
    (tau, link), brute, kept = brute_heldout_choice(post, prior.grid,
                                                    lambda: post.predictive(batch), y)
    assert (prior.tau, prior.link) == (tau, link) and prior.map_kept == kept
    assert prior.nll == pytest.approx(brute[(tau, link)], rel=1e-9)
    assert prior.marglik_tau in prior.grid
    assert len(set(brute.values())) > 1  # the candidates differ: the choice is not trivial
    # MAP's own held-out figures, from the same pass
    with torch.no_grad():
        p_map = torch.softmax(model(**batch).logits.double(), -1)
    assert prior.map_nll == pytest.approx(float(-p_map[torch.arange(10), y].log().mean()),
                                          rel=1e-6)
    assert prior.map_accuracy == float((p_map.argmax(-1) == y).double().mean())
    assert prior.map_confidence == pytest.approx(float(p_map.max(-1).values.mean()), rel=1e-6)


def test_prior_precision_without_an_eval_set_warns_once_at_train_begin(tmp_path, caplog):
    """One warning line before the first step, none at the end; the snapshot then
    has no held-out prior (``heldout_prior`` is None, as documented)."""
    import logging

    from transformers import Trainer, TrainerCallback, TrainingArguments

    from kfac_stream import KFACStreamCallback

    class FirstStep(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            logging.getLogger("kfac_stream").info("STEP")

    cb = KFACStreamCallback(KFACConfig(output_dir=str(tmp_path / "kfac")),
                            heldout=HeldoutConfig(prior_precision=True, answer_tokens=[65, 66]))
    args = TrainingArguments(str(tmp_path), per_device_train_batch_size=2, max_steps=2,
                             report_to=[], save_strategy="no", disable_tqdm=True, use_cpu=True)
    with caplog.at_level(logging.INFO, logger="kfac_stream"):
        Trainer(model=tiny_gpt2(torch.float32), args=args,
                train_dataset=ListDataset(text_examples(4, 8)),
                callbacks=[cb, FirstStep()]).train()
    lines = [r.getMessage() for r in caplog.records]
    warned = [i for i, m in enumerate(lines) if m.startswith("kfac_stream: HeldoutConfig(")]
    assert len(warned) == 1 and warned[0] < lines.index("STEP"), [lines[i] for i in warned]
    assert "has no eval_dataset" in lines[warned[0]] and "\n" not in lines[warned[0]]
    assert Snapshot.load(cb.snapshots[-1]).heldout_prior is None


def test_one_update_window_is_flagged_by_its_sampling_error(tmp_path):
    """A final window of one update (``min_window_sequences=0``): no spread to measure, the
    relative error is infinite and the snapshot is flagged for it; the same run with the EMA
    throughout is not judged by that figure (its spread is the curvature's drift)."""
    _, snap = _short_run(tmp_path / "one", {"min_window_sequences": 0, "final_window": 0.2})
    s = sampling_summary(snap.manifest)
    assert s["in_window"] and s["max_rel_se"] == math.inf
    assert any("relative sampling error of inf" in p for p in sampling_problems(snap.manifest))
    _, ema = _short_run(tmp_path / "ema", {"min_window_sequences": 0, "final_window": 0.0})
    assert not sampling_summary(ema.manifest)["in_window"]
    assert sampling_problems(ema.manifest) == []


def test_factors_without_rows_are_flagged(tmp_path, monkeypatch):
    """A run whose MC replays capture no row (what a replay in eval mode would give if the
    capture took only training-mode forwards) leaves every factor's weight 0: the snapshot is
    flagged, by name, at query time; a normal run's is not."""
    import dataclasses

    import kfac_stream.fisher.mc_replay as mc_replay
    from kfac_stream.snapshot.adequacy import empty_factors

    _, ok = _short_run(tmp_path / "ok", {"min_window_sequences": 0, "final_window": 0.0})
    assert empty_factors(ok.manifest) == []
    monkeypatch.setattr(mc_replay, "MC_REPLAY", dataclasses.replace(mc_replay.MC_REPLAY,
                                                                    replay=False))
    model, snap = _short_run(tmp_path / "none", {"min_window_sequences": 0,
                                                 "final_window": 0.0})
    empty = empty_factors(snap.manifest)
    assert len(empty) == 2 * len(snap.layer_names)
    assert all(float(snap[n].A.abs().sum()) == 0.0 for n in snap.layer_names)
    problems = sampling_problems(snap.manifest)
    assert any(p.startswith(f"{len(empty)} of its factors hold no rows at all ({empty[0]}, ")
               for p in problems), problems
    with pytest.warns(UserWarning, match="hold no rows at all"):
        LaplacePosterior(model, snap, prior_precision=1.0)
