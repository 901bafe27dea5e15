"""The held-out fit of a language model without answer tokens (`kfac_stream.query.heldout_tokens`):
a causal LM's eval texts scored per next token of the linearised predictive, under the guard.

References, each independent of the code under test:
* the scored labels: a Python loop over rows and positions (next token, then evenly spaced
  ranks among the row's labelled positions);
* MAP's per-token NLL, unthinned: the model's own training loss (Hugging Face's shifted
  cross-entropy) on the same batch;
* the candidates' NLL: ``sampled_predictive(..., linearized=True, return_logits=True)``'s logits
  of each draw, averaged in probability by hand at the scored positions;
* through the Trainer with its eval set and the defaults (``HeldoutConfig.prior_precision="auto"``):
  the stored fit's every number recomputed by `fit_prior_precision` on the eval loader's
  batches, and the guard's decision by its rule.

One training run (module fixture, ~3 s): a 2-layer byte-level GPT-2, 8 steps.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from transformers import Trainer, TrainingArguments

from kfac_stream import KFACConfig, KFACStreamCallback, LaplacePosterior, Snapshot
from kfac_stream.query import heldout_tokens as ht
from kfac_stream.query.heldout_tau import fit_prior_precision
from kfac_stream.query.sampled import sampled_predictive

from logreaders import Lines
from models import ListDataset, text_examples, tiny_gpt2

#: float64 model and posterior: the two ways of summing the same draws agree to round-off.
SUM_TOL = 1e-9
#: Hugging Face's causal-LM loss casts the logits to float32 before its cross-entropy.
HF_LOSS_TOL = 1e-6


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``(model, callback, eval examples, log lines)`` of a short LM run with an eval set."""
    tmp = tmp_path_factory.mktemp("heldout_tokens")
    model = tiny_gpt2(torch.float64)
    train = text_examples(16, 12, seed=0)
    held = text_examples(6, 12, seed=1, lengths=[12, 12, 9, 5, 12, 12])
    cb = KFACStreamCallback(KFACConfig(output_dir=str(tmp / "kfac"), storage_dtype="float32"))
    args = TrainingArguments(str(tmp), per_device_train_batch_size=2,
                             per_device_eval_batch_size=4, max_steps=8, learning_rate=1e-2,
                             report_to=[], save_strategy="no", logging_strategy="no",
                             disable_tqdm=True, use_cpu=True, seed=0)
    with Lines() as log:
        Trainer(model=model, args=args, train_dataset=ListDataset(train),
                eval_dataset=ListDataset(held), callbacks=[cb]).train()
    return model.eval(), cb, held, log.lines


def _stack(examples) -> dict[str, torch.Tensor]:
    return {k: torch.stack([e[k] for e in examples]) for k in examples[0]}


def _posterior(model, snap, tau) -> LaplacePosterior:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the few-samples note of a short run
        return LaplacePosterior(model, snap, tau)


def _want_scored(labels: torch.Tensor, per_row: int) -> torch.Tensor:
    """The scored labels by a loop: next token, then ``per_row`` evenly spaced ranks."""
    out = torch.full_like(labels, -100)
    for b in range(labels.shape[0]):
        nxt = [(t, int(labels[b, t + 1])) for t in range(labels.shape[1] - 1)
               if int(labels[b, t + 1]) != -100]
        n = len(nxt)
        ranks = {0} if per_row == 1 and n else (
            set(range(n)) if n <= per_row else
            {round(j * (n - 1) / (per_row - 1)) for j in range(per_row)})
        for r in ranks:
            t, y = nxt[r]
            out[b, t] = y
    return out


@pytest.mark.parametrize("per_row", [1, 3, 4, 32])
def test_scored_labels_are_the_next_tokens_evenly_thinned(trained, per_row):
    model, _, held, _ = trained
    batch = _stack(held)
    got = ht.scored_labels("t", batch, model, per_row)
    assert torch.equal(got, _want_scored(batch["labels"], per_row))
    counts = (got != -100).sum(1).tolist()
    lengths = [12, 12, 9, 5, 12, 12]
    assert counts == [min(per_row, n - 1) for n in lengths]
    # without labels: input_ids where the attention mask is 1 give the same tokens
    bare = {k: v for k, v in batch.items() if k != "labels"}
    assert torch.equal(ht.scored_labels("t", bare, model, per_row), got)


def test_first_rows_cuts_the_batch_that_crosses_the_count():
    batches = [{"input_ids": torch.arange(3 * 4).reshape(3, 4), "note": "x"} for _ in range(3)]
    got = list(ht.first_rows(iter(batches), 7))
    assert [b["input_ids"].shape[0] for b in got] == [3, 3, 1]
    assert torch.equal(got[2]["input_ids"], batches[2]["input_ids"][:1]) and got[2]["note"] == "x"
    assert [b["input_ids"].shape[0] for b in ht.first_rows(iter(batches), None)] == [3, 3, 3]


def test_token_nll_is_the_sampled_predictive_at_the_scored_positions(trained):
    model, cb, held, _ = trained
    snap = Snapshot.load(cb.snapshots[-1])
    post = _posterior(model, snap, 1.0)
    batch = _stack(held)
    labels = ht.scored_labels("t", batch, model, 3)
    taus = [0.5, 40.0]
    got, map_nll = ht.token_nll(post, batch, labels, taus, n_samples=5, seed=7)
    keep = labels != -100
    assert got.shape == (2, int(keep.sum())) and map_nll.shape == (int(keep.sum()),)
    for i, tau in enumerate(taus):
        post.prior_precision = tau
        pred = sampled_predictive(post, batch, n_samples=5, seed=7, labels=labels.clamp(min=0),
                                  linearized=True, return_logits=True)
        logp = torch.log_softmax(pred.sample_logits.double(), -1)  # [S, B, T, V]
        at = logp.gather(-1, labels.clamp(min=0)[None, ..., None].expand(5, -1, -1, 1))[..., 0]
        want = -(torch.logsumexp(at, 0) - math.log(5))[keep]
        torch.testing.assert_close(got[i], want, rtol=SUM_TOL, atol=SUM_TOL)
    # MAP's per-token NLL, every position scored, is the model's own training loss
    full = ht.scored_labels("t", batch, model, 10_000)
    _, map_all = ht.token_nll(post, batch, full, [1.0], n_samples=2, seed=0)
    with torch.no_grad():
        loss = model(**batch).loss
    assert float(map_all.mean()) == pytest.approx(float(loss), rel=HF_LOSS_TOL)


def test_the_trainer_fits_a_language_model_without_answer_tokens(trained):
    model, cb, held, lines = trained
    snap = Snapshot.load(cb.snapshots[-1])
    prior = snap.heldout_prior
    assert prior is not None, lines
    assert prior.link == "mc" and prior.map_nll is not None
    scored = int((ht.scored_labels("t", _stack(held), model) != -100).sum())
    assert prior.examples == scored == 11 + 11 + 8 + 4 + 11 + 11  # every next token (< 32)
    assert list(prior.grid) == ht.token_grid(prior.marglik_tau) and len(prior.grid) == 5
    # the stored fit is fit_prior_precision's on the eval loader's batches, number for number
    post = _posterior(model, snap, 1.0)
    batches = [_stack(held[:4]), _stack(held[4:])]
    again = fit_prior_precision(post, batches)
    assert again.tau == prior.tau and again.map_kept == prior.map_kept
    assert again.grid_nll == pytest.approx(prior.grid_nll, rel=SUM_TOL)
    assert again.map_nll == pytest.approx(prior.map_nll, rel=SUM_TOL)
    # the guard: the posterior replaces MAP only beyond 2 paired standard errors
    assert prior.nll == min(prior.grid_nll)
    assert prior.map_kept == (not prior.map_gain > 2 * prior.map_gain_se)
    assert prior.map_gain == pytest.approx(prior.map_nll - prior.nll, rel=1e-9, abs=1e-12)
    # said before (what runs, its cost) and after (the verdict)
    said = [m for m in lines if m.startswith("kfac_stream: held-out fit")]
    assert "the NLL per label token of the linearised next-token predictive" in said[0], said
    assert "about 161 forwards" in said[0] and "5 candidate taus" in said[0]
    assert any(f"held-out fit on {scored} eval label tokens" in m for m in said), said
    # the default posterior takes the fitted tau
    assert LaplacePosterior(model, snap).prior_precision == pytest.approx(prior.tau)


def test_the_fit_reads_only_the_first_rows(trained):
    model, cb, held, _ = trained
    post = _posterior(model, Snapshot.load(cb.snapshots[-1]), 1.0)
    batches = [_stack(held[:4]), _stack(held[4:])]
    first3 = fit_prior_precision(post, batches, max_sequences=3, n_samples=4)
    assert first3.examples == 11 + 11 + 8
    alone = fit_prior_precision(post, [_stack(held[:3])], n_samples=4)
    assert first3.grid_nll == pytest.approx(alone.grid_nll, rel=SUM_TOL)


@pytest.mark.parametrize("kept", [True, False, None])
def test_the_query_footer_says_when_the_fit_kept_maps_probabilities(kept):
    from kfac_stream.query.token_table import footer

    meta = {"snapshot": "s", "step": 3, "num_data": 10.0, "prior_precision": 2.0, "samples": 4,
            "seed": 0, "seconds": 1.25, "mode": "tokens", "linearized": True}
    if kept is not None:
        meta["heldout"] = {"map_kept": kept}
    line = footer(meta)
    assert line.startswith("snapshot s (step 3); N = 10, prior precision τ = 2, S = 4 posterior "
                           "samples, linearised (seed 0)") and line.endswith("; 1.2 s")
    assert ("kept MAP's probabilities" in line and "read p from the MAP column" in line) == \
        bool(kept)
