"""Early stopping with ``load_best_model_at_end=True``: the Trainer reloads the best
checkpoint's weights before ``on_train_end``, so the final snapshot describes those weights.

A real Trainer (tiny BERT classifier, eval set, `EarlyStoppingCallback`) whose metric is
forced to peak at the second evaluation (step 4) and stop two evaluations later (step 8 of
20): the final snapshot keeps the name of its factors' step (8) and records the weights' step
(4, ``weights_from``, `Snapshot.weights_step`); its fingerprint equals the fingerprint of the
model loaded from ``checkpoint-4`` (recomputed here), that model queries it without the
mismatch warning while ``checkpoint-8``'s gets one naming step 4, the held-out fit's MAP NLL
is ``checkpoint-4``'s on the eval set (recomputed here) and not ``checkpoint-8``'s, and the
end-of-train line names the reloaded step and the factors' window. Two cases: the final
snapshot written at train end, and the step's snapshot written during training and relabelled
(``snapshot_every`` divides the last step).
"""

from __future__ import annotations

import os
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import EarlyStoppingCallback, Trainer, TrainingArguments

from kfac_stream import KFACConfig, KFACStreamCallback, LaplacePosterior, Snapshot
from kfac_stream.integrations.best_model import reloaded_best_model
from kfac_stream.snapshot.manifest_types import WeightsFrom, to_json
from kfac_stream.snapshot.weights import weights_fingerprint

from logreaders import Lines
from models import ListDataset, labelled_examples

BEST, LAST, MAX_STEPS = 4, 8, 20
#: eval_score by evaluation (every 2 steps): best at the 2nd (step 4); patience 2 stops at the
#: 4th (step 8)
SCORES = (1.0, 3.0, 2.0, 1.0)
#: The held-out fit's MAP NLL against the one recomputed here: both float32 forwards of the
#: same weights on the same 12 examples (batched alike), reduced in float64.
NLL_TOL = 1e-5
MISMATCH = "weights are not those snapshot"


def _classifier():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=256, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=32, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _train(tmp, kfac: dict):
    """Train with early stopping; ``(trainer, callback, log lines)``."""
    evals = iter(SCORES)
    cb = KFACStreamCallback(KFACConfig(output_dir=str(tmp / "kfac"), update_every=1,
                                       min_window_sequences=0, mc_sequences=1,
                                       **kfac))
    args = TrainingArguments(
        str(tmp / "out"), per_device_train_batch_size=4, per_device_eval_batch_size=4,
        max_steps=MAX_STEPS, learning_rate=1e-2, eval_strategy="steps", eval_steps=2,
        save_strategy="steps", save_steps=2, load_best_model_at_end=True,
        metric_for_best_model="score", greater_is_better=True, report_to=[],
        logging_strategy="no", disable_tqdm=True, use_cpu=True, seed=0)
    trainer = Trainer(model=_classifier(), args=args,
                      train_dataset=ListDataset(labelled_examples(24, 0)),
                      eval_dataset=ListDataset(labelled_examples(12, 1)),
                      compute_metrics=lambda _: {"score": next(evals)},
                      callbacks=[cb, EarlyStoppingCallback(early_stopping_patience=2)])
    with Lines() as log:
        trainer.train()
    return trainer, cb, log.lines


def _checkpoint_model(trainer, step: int):
    from transformers import BertForSequenceClassification

    path = os.path.join(trainer.args.output_dir, f"checkpoint-{step}")
    return BertForSequenceClassification.from_pretrained(path).eval()


def _eval_nll(model, examples) -> float:
    """MAP's mean NLL on ``examples`` (float32 forward, float64 softmax)."""
    with torch.no_grad():
        logits = torch.cat([model(input_ids=torch.stack([e["input_ids"] for e in part]),
                                  attention_mask=torch.stack([e["attention_mask"]
                                                              for e in part])).logits
                            for part in (examples[i:i + 4] for i in range(0, len(examples), 4))])
    labels = torch.stack([e["labels"] for e in examples])
    return float(F.cross_entropy(logits.double(), labels))


def _mismatch_warnings(model, snap) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        LaplacePosterior(model, snap)
    return [str(w.message) for w in caught if MISMATCH in str(w.message)]


@pytest.mark.parametrize("kfac,factors", [
    # written at train end; the final window (from step 5 of 20) started before the stop
    # (final_refresh off: "auto" would refresh a window over 75% of the run at the reloaded
    # weights, and the line would say so)
    ({"final_window": 0.75, "final_refresh": "off"},
     "the final window's mean of the factor updates from step 5 to 8"),
    # step 8's snapshot written in the run, relabelled at train end; the window (from step 18)
    # never started
    ({"snapshot_every": 4},
     "the EMA of the factor updates up to step 8 (the final window, planned from step 18 of "
     "20, had not started when training stopped)"),
], ids=["written-at-end", "relabelled"])
def test_final_snapshot_describes_the_reloaded_weights(tmp_path, kfac, factors):
    trainer, cb, lines = _train(tmp_path, kfac)
    # the run stopped early and the best checkpoint is an earlier one
    assert trainer.state.global_step == LAST < MAX_STEPS
    assert os.path.basename(trainer.state.best_model_checkpoint) == f"checkpoint-{BEST}"

    snap = Snapshot.latest(tmp_path / "kfac")
    assert snap.step == LAST and snap.weights_step == BEST
    assert snap.manifest.weights_from == WeightsFrom(
        step=BEST, reason="load_best_model_at_end",
        checkpoint=trainer.state.best_model_checkpoint)
    assert snap.manifest.counts.updates == LAST  # the factors: every update up to step 8
    if "snapshot_every" in kfac:  # step 4's own snapshot: the same weights, as taken then
        own = Snapshot.load(tmp_path / "kfac" / f"step-{BEST:08d}")
        assert own.weights_step == BEST and own.manifest.weights_from is None
        assert own.manifest.weights == snap.manifest.weights

    best, last = _checkpoint_model(trainer, BEST), _checkpoint_model(trainer, LAST)
    modules = dict(best.named_modules())
    assert weights_fingerprint({n: modules[n] for n in snap.layer_names}) == \
        to_json(snap.manifest.weights)
    last_modules = dict(last.named_modules())
    assert weights_fingerprint({n: last_modules[n] for n in snap.layer_names}) \
        != to_json(snap.manifest.weights)

    assert _mismatch_warnings(best, snap) == []
    (warned,) = _mismatch_warnings(last, snap)
    assert f"(step {BEST}, the best model the Trainer reloaded" in warned
    assert f"its factors run to step {LAST})" in warned

    fit = snap.heldout_prior
    eval_set = labelled_examples(12, 1)
    best_nll, last_nll = _eval_nll(best, eval_set), _eval_nll(last, eval_set)
    assert fit.examples == 12
    assert fit.map_nll == pytest.approx(best_nll, rel=NLL_TOL)
    assert abs(last_nll - best_nll) > 100 * NLL_TOL * best_nll  # the check can fail

    (line,) = [s for s in lines if "load_best_model_at_end" in s]
    assert (f"the Trainer reloaded the best model (step {BEST}, "
            f"{trainer.state.best_model_checkpoint}) before train end, so the final snapshot "
            f"{tmp_path / 'kfac' / f'step-{LAST:08d}'} describes the weights of step {BEST}"
            in line)
    assert f"{factors}, not re-estimated at the step {BEST} weights" in line


def test_no_reload_no_label():
    """`reloaded_best_model` reads what ``Trainer._load_best_model`` runs on: none without
    ``load_best_model_at_end`` or a best checkpoint, none when the best is the last step; the
    step from the folder name, else ``state.best_global_step``."""
    state = SimpleNamespace(best_model_checkpoint="/run/checkpoint-176", global_step=220,
                            best_global_step=176)
    on, off = SimpleNamespace(load_best_model_at_end=True), \
        SimpleNamespace(load_best_model_at_end=False)
    assert reloaded_best_model(off, state) is None
    assert reloaded_best_model(on, SimpleNamespace(**{**vars(state),
                                                     "best_model_checkpoint": None})) is None
    assert reloaded_best_model(on, SimpleNamespace(**{**vars(state), "global_step": 176})) \
        is None
    found = reloaded_best_model(on, state)
    assert (found.step, found.checkpoint) == (176, "/run/checkpoint-176")
    renamed = SimpleNamespace(**{**vars(state), "best_model_checkpoint": "/run/best"})
    assert reloaded_best_model(on, renamed).step == 176
