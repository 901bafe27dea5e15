"""``KFACConfig.final_refresh``: at train end the factors are replaced by their plain mean over
a pass at the final weights, where the run's final window cannot give them.

The references are independent of the tracker: the float64 brute force of `reference` (a
private copy of the model, its own hooks, the summed NLL's gradients) at the trained weights
over the same sequences, and over the final window's recorded forwards (each at the weights it
ran with) for the factors a run keeps without the refresh. The training itself must not see
the refresh: the weights and every global generator after ``train()`` equal those of a run
without the callback, bit for bit.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from transformers import Trainer, TrainingArguments

from kfac_stream import KFACConfig, KFACConfigError, KFACStreamCallback, Snapshot
from kfac_stream.snapshot.manifest_types import RefreshDecision
from kfac_stream.tracking.plan import RunPlan, RunShape, plan_refresh, plan_window
from kfac_stream.tracking.refresh import sequence_cost_ratio

from harness import run
from models import ListDataset, text_examples, tiny_gpt2
from reference import reference_factors, rel_err

#: A: float64 end to end (model, rows, storage): only summation order separates the two.
A_TOL = 1e-10
#: G: the refresh differentiates the model's own loss, and transformers' causal-LM loss casts
#: the logits to float32 (``ForCausalLMLoss``: ``logits.float()``), so every g carries float32
#: rounding (measured 1.2e-7 relative; the float64 brute force sums NLLs in float64). A wrong
#: position, weight or loss scale would be off by far more than 1e-6.
G_TOL = 1e-6
#: The factors a run keeps without the refresh (its final window's, at earlier weights) are
#: further from the final weights' than this: the comparison above can fail.
MOVED = 1e-3
LAYERS = [f"transformer.h.{i}.{m}" for i in range(2)
          for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
#: 8 sequences, batch 4, 30 steps: 120 training sequences; 10% of the training's FLOPs is
#: 120 × 0.1 / 1.35 (`_cost_ratio`) = 8.9 sequences, so one epoch (8) bounds the refresh
EXACT = dict(token_fraction=1.0, storage_dtype="float64", update_every=1, fisher="empirical",
             ema_decay=0.95, final_window=0.1, min_window_sequences=0)


def _snapshot_errors(snap: Snapshot, ref: dict) -> tuple[float, float]:
    """The largest relative Frobenius errors of the snapshot's A and of its G."""
    return (max(rel_err(snap[n].A, ref[n][0]) for n in ref),
            max(rel_err(snap[n].G, ref[n][1]) for n in ref))


def _batch(examples: list[dict]) -> dict:
    return {k: torch.stack([e[k] for e in examples]) for k in examples[0]}


@pytest.mark.parametrize("refresh", ["on", "off"])
def test_final_snapshot_factors_at_the_final_weights(tmp_path, refresh):
    """``"on"``: the final snapshot's A and G are the brute-force factors at the trained weights
    over the epoch's 8 sequences (its budget: 8.9), recorded as a refresh in the manifest.
    ``"off"``: they are the final window's mean (steps 27 to 29, each at the weights it ran
    with), as without the option, and no refresh is recorded. Each is the other's
    control: the two references differ by more than `MOVED`."""
    model, examples = tiny_gpt2(), text_examples(8, 10)
    cb, records, _ = run(model, examples, {**EXACT, "final_refresh": refresh}, batch=4,
                         steps=30, lr=3e-2, tmp_path=tmp_path)
    snap = Snapshot.latest(tmp_path / "kfac")
    assert snap.step == 30 and len(records) == 30
    final, _ = reference_factors(model, [{"kwargs": _batch(examples)}], LAYERS)
    window, _ = reference_factors(model, records[27:], LAYERS)
    assert min(max(rel_err(final[n][i], window[n][i]) for i in (0, 1)) for n in LAYERS) > MOVED
    kept = final if refresh == "on" else window
    a_err, g_err = _snapshot_errors(snap, kept)
    print(f"{refresh}: largest relative error of A {a_err:.1e}, of G {g_err:.1e}")
    assert a_err < A_TOL and g_err < G_TOL
    if refresh == "on":
        assert snap.manifest.final_refresh.sequences == 8
        assert cb.session.refreshed.sequences == 8 and cb.session.refreshed.batches == 2
        assert snap.manifest.run_plan.final_refresh == RefreshDecision(
            on=True, reason="final_refresh='on'")
        # the window's own bookkeeping is the training's (restart at step 27)
        assert snap.manifest.counts.window_start_step == 27
    else:
        assert snap.manifest.final_refresh is None and cb.session.refreshed is None
    assert all(p.grad is None for p in model.parameters())  # no gradient left by the pass


def _cost_ratio(model) -> float:
    """A refreshed sequence's FLOPs over a training one's, per token, by hand for the tiny
    GPT-2's 8 tracked Conv1D layers (no shared inputs): (4P + Σ 2·(d_in+1)² + 2·d_out²) / 6P."""
    total = sum(p.numel() for p in model.parameters())
    fold = sum(2 * (w.shape[0] + 1) ** 2 + 2 * w.shape[1] ** 2
               for w in (model.get_submodule(n).weight for n in LAYERS))
    return (4 * total + fold) / (6 * total)


def test_budget_cuts_the_pass_at_ten_percent_of_the_flops(tmp_path):
    """7 steps at batch 4 train on 28 sequences: the refresh takes 2 (10% of the training's
    FLOPs: 28 × 0.1 / 1.35, rounded down), the first batch cut to them, not the epoch's 8."""
    model = tiny_gpt2()
    ratio = _cost_ratio(model)
    assert 1.3 < ratio < 1.4
    assert sequence_cost_ratio(model, {f"{n}.{f}": (d, False) for n in LAYERS for f, d in (
        ("A", model.get_submodule(n).weight.shape[0] + 1),
        ("G", model.get_submodule(n).weight.shape[1]))}) == pytest.approx(ratio, rel=1e-12)
    cb, _, _ = run(model, text_examples(8, 10), {**EXACT, "final_refresh": "on"},
                   batch=4, steps=7, tmp_path=tmp_path, record=False)
    snap = Snapshot.latest(tmp_path / "kfac")
    assert snap.manifest.final_refresh.sequences == 2 == cb.session.refreshed.sequences
    assert cb.session.refreshed.batches == 1
    assert all(snap[n].A.diagonal().sum() > 0 for n in LAYERS)


# -- the training does not see it -------------------------------------------------------------

STEPS = 24  # 6 epochs of 16 sequences at batch 4: 6 shuffles from the global generator


def _generators() -> tuple:
    return (torch.get_rng_state(), random.getstate(), np.random.get_state())


def _train(tmp_path, cfg: dict | None) -> tuple[dict, tuple, KFACStreamCallback | None]:
    """A float32 tiny GPT-2 with dropout 0.1 trained `STEPS` steps (with a callback of ``cfg``;
    None: without); returns its weights, the global generators after ``train()``, the
    callback."""
    model = tiny_gpt2(torch.float32, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    cb = None if cfg is None else KFACStreamCallback(KFACConfig(**cfg), report_spectra=False)
    args = TrainingArguments(
        str(tmp_path), per_device_train_batch_size=4, max_steps=STEPS, learning_rate=3e-3,
        lr_scheduler_type="constant", warmup_steps=0, report_to=[], logging_strategy="no",
        save_strategy="no", disable_tqdm=True, seed=0, use_cpu=True)
    Trainer(model=model, args=args, train_dataset=ListDataset(text_examples(16, 12)),
            callbacks=[cb] if cb else []).train()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = [p.grad for p in model.parameters()]
    assert all(g is None or not g.any() for g in grads)
    return weights, _generators(), cb


def _same_generators(a: tuple, b: tuple) -> bool:
    np_same = a[2][0] == b[2][0] and np.array_equal(a[2][1], b[2][1]) and a[2][2:] == b[2][2:]
    return torch.equal(a[0], b[0]) and a[1] == b[1] and np_same


@pytest.mark.parametrize("cfg", [
    dict(snapshot_every=10_000),  # "auto" on this short run: the MC replay of every sequence
    dict(snapshot_every=10_000, final_refresh="off"),
    dict(snapshot_every=10_000, fisher="empirical", final_refresh="on"),
], ids=["mc-auto-on", "off", "empirical-on"])
def test_training_is_bit_identical_with_and_without_the_refresh(tmp_path, cfg):
    plain, plain_rng, _ = _train(tmp_path / "plain", None)
    tracked, tracked_rng, cb = _train(tmp_path / "tracked", cfg)
    assert (cb.session.refreshed is not None) == (cfg.get("final_refresh") != "off")
    apart = [n for n in plain if not torch.equal(plain[n], tracked[n])]
    assert not apart, f"{len(apart)} weights differ"
    assert _same_generators(plain_rng, tracked_rng)


# -- the plan's "auto" rule and the train-begin line -------------------------------------------


def test_auto_rule_on_the_window_start():
    """On when the planned final window starts in the first half of the run, off otherwise,
    off without a window; "on" and "off" whatever the window."""
    cfg = KFACConfig()
    short = RunPlan.resolve(cfg, shape=RunShape(batch=8, max_steps=100))
    assert short.window.restart_step == 0 and short.refresh.on
    assert short.refresh.reason.startswith("the final window spans 100% of the run")
    long = RunPlan.resolve(KFACConfig(fisher="empirical"),
                           shape=RunShape(batch=8, max_steps=20_000))
    assert long.window.restart_step == 18_000 and not long.refresh.on
    assert long.refresh.reason == "the final window spans the last 10% of the run"
    half = plan_window(KFACConfig(min_window_sequences=0, final_window=0.5), 100, 8)
    assert half.restart_step == 50
    assert not plan_refresh(KFACConfig(final_window=0.5), half, 100).on  # 50 is not < 50
    assert plan_refresh(KFACConfig(final_window=0.5), plan_window(
        KFACConfig(final_window=0.5), 100, 8), 100).on  # pushed back to 0 for 256 sequences
    assert not plan_refresh(cfg, None, 100).on  # no window: the EMA throughout
    assert plan_refresh(KFACConfig(final_refresh="on"), long.window, 20_000).on
    assert not plan_refresh(KFACConfig(final_refresh="off"), short.window, 100).on
    assert short.to_dict()["final_refresh"]["on"] and "final-weight refresh: on (the final " \
        "window spans 100% of the run: factors averaged over weights far from the final " \
        "ones)" in short.describe()
    assert "final-weight refresh: off (the final window spans the last 10% of the run)" in \
        long.describe()


def test_refused_and_off_where_unsupported():
    with pytest.raises(KFACConfigError, match="final_refresh='yes' is not allowed"):
        KFACConfig(final_refresh="yes")
    with pytest.raises(KFACConfigError, match="final_refresh='on' is not allowed with ekfac"):
        KFACConfig(final_refresh="on", ekfac=True)
    assert not plan_refresh(KFACConfig(ekfac=True), plan_window(KFACConfig(), 100, 8), 100).on
    window = plan_window(KFACConfig(), 100, 8)
    off = plan_refresh(KFACConfig(), window, 100, sharded_by="ZeRO-3")
    assert not off.on and off.reason == "not supported under ZeRO-3"
    with pytest.raises(KFACConfigError, match="final_refresh='on' is not supported under FSDP2"):
        plan_refresh(KFACConfig(final_refresh="on"), window, 100, sharded_by="FSDP2")


@pytest.mark.parametrize("steps,on", [(8, True), (60, False)], ids=["short", "long"])
def test_auto_in_a_real_run_says_it_at_train_begin(tmp_path, caplog, steps, on):
    """A run of 8 steps (window pushed back to step 0 for its 256 sequences) refreshes; one of
    60 steps with ``min_window_sequences=0`` (window over the last 10%) does not."""
    cfg = {**EXACT, "final_window": 0.1, "min_window_sequences": 0 if steps == 60 else 256}
    with caplog.at_level("INFO", logger="kfac_stream"):
        cb, _, _ = run(tiny_gpt2(), text_examples(8, 10), cfg, batch=4, steps=steps,
                       tmp_path=tmp_path, record=False)
    said = ("final-weight refresh: on (the final window spans 100% of the run" if on
            else "final-weight refresh: off (the final window spans the last 10% of the run)")
    begin = next(r.getMessage() for r in caplog.records if "tracking 8 layers" in r.getMessage())
    assert said in begin
    snap = Snapshot.latest(tmp_path / "kfac")
    assert (snap.manifest.final_refresh is not None) == on == (cb.session.refreshed is not None)
    end = [r.getMessage() for r in caplog.records if "s in the callback" in r.getMessage()]
    assert ("the final-weight refresh over" in end[0]) == on
