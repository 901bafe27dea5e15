"""Queries on seq2seq models: T5 and BART, tiny, built from their configs (d_model 32,
one layer each side, vocabulary 96), trained for a few steps by a real ``Seq2SeqTrainer`` with
``KFACStreamCallback(heldout=HeldoutConfig(prior_precision=True))`` and an eval set.

What the numbers must satisfy (computed here, independently of the code under test): a batch
with ``labels`` only gives the predictive whose mean is the model's own logits with the decoder
inputs shifted right by hand (decoder start token first, ``-100`` as padding), read at each
row's first labelled decoder position (decoder inputs without labels: at the positions given);
the tau fitted on the eval set is finite, the best of its candidates, and at the largest
candidate (a posterior of almost no width) its held-out NLL per label token is the trained
model's own cross-entropy; a batch with neither labels nor decoder inputs is refused with one
line, before any forward.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F

from kfac_stream import (
    HeldoutConfig,
    KFACConfig,
    KFACStreamCallback,
    LaplacePosterior,
    Snapshot,
    fit_prior_precision,
)
from kfac_stream.exceptions import QueryInputError
from kfac_stream.query.heldout_tokens import token_grid
from kfac_stream.query.sampled import sampled_predictive

from models import ListDataset, tiny_seq2seq

#: Training and the eval set: targets as long as the inputs (other decoder lengths train too:
#: tests/unit/capture/test_loss_positions.py); queries: ``TGT`` < ``SRC``.
VOCAB, SRC, TGT = 96, 8, 6
STEPS, BATCH = 4, 4
#: The predictive mean is the MAP logits: the same float32 forward, run twice (eval mode).
MEAN_TOL = 1e-5
#: At tau = 1e6 the posterior is nearly a point (measured: 7e-5 relative for T5, 1e-7 for BART):
#: the MC predictive's NLL per label token is the MAP's within this (relative).
MAP_NLL_TOL = 1e-3
#: MAP's own NLL per label token, the guard's reference: the same float32 forward on eval
#: batches of 4 instead of one stacked batch (relative; float32 rounding only).
MAP_OWN_TOL = 1e-5


def _build(family: str):
    return tiny_seq2seq(family, VOCAB)


def _examples(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Translate ``x`` into ``(3x + 1) mod V`` (ids >= 3: no special token); every third target
    ends in two ``-100`` (no label), as a padded target does."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(3, VOCAB, (SRC,), generator=gen)
        labels = ((ids * 3 + 1) % VOCAB).clamp(min=3)
        if i % 3 == 2:
            labels[-2:] = -100
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    return out


def _stack(examples, keys=("input_ids", "attention_mask", "labels"), tgt: int = SRC):
    """A batch; its labels cut to ``tgt`` decoder positions (the last two of every third row
    ``-100``)."""
    out = {k: torch.stack([e[k] for e in examples]) for k in keys}
    if "labels" in out and tgt != SRC:
        out["labels"] = out["labels"][:, :tgt].clone()
        out["labels"][2::3, -2:] = -100
    return out


def _shift_right(model, labels: torch.Tensor) -> torch.Tensor:
    """The decoder inputs of training, by hand: start token, then the labels but the last,
    ``-100`` replaced by the pad id."""
    cfg = model.config
    dec = torch.full_like(labels, cfg.pad_token_id)
    dec[:, 0] = cfg.decoder_start_token_id
    dec[:, 1:] = labels[:, :-1]
    return dec.masked_fill(dec == -100, cfg.pad_token_id)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[int, str]] = []

    def emit(self, record):
        self.lines.append((record.levelno, record.getMessage()))


@pytest.fixture(scope="module", params=["t5", "bart"])
def run(request, tmp_path_factory):
    """``(family, model in eval mode, callback, snapshot, eval examples, kfac log lines)``."""
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

    family = request.param
    tmp = tmp_path_factory.mktemp(family)
    model = _build(family)
    train, held = _examples(STEPS * BATCH, seed=1), _examples(6, seed=2)
    cb = KFACStreamCallback(KFACConfig(token_fraction=1.0, update_every=1, snapshot_every=STEPS,
                                       output_dir=str(tmp / "kfac")),
                            heldout=HeldoutConfig(prior_precision=True))
    args = Seq2SeqTrainingArguments(str(tmp), per_device_train_batch_size=BATCH,
                                    per_device_eval_batch_size=4, max_steps=STEPS,
                                    learning_rate=1e-3, report_to=[], logging_strategy="no",
                                    save_strategy="no", disable_tqdm=True, use_cpu=True, seed=0)
    log = logging.getLogger("kfac_stream")
    lines, level = _Lines(), log.level
    log.addHandler(lines)
    log.setLevel(logging.DEBUG)
    try:
        Seq2SeqTrainer(model=model, args=args, train_dataset=ListDataset(train),
                       eval_dataset=ListDataset(held), callbacks=[cb]).train()
    finally:
        log.removeHandler(lines)
        log.setLevel(level)
    return family, model.eval(), cb, Snapshot.load(cb.snapshots[-1]), held, lines.lines


def test_predictive_of_a_batch_with_labels_only_is_the_models_own_logits(run):
    family, model, _, snap, held, _ = run
    post = LaplacePosterior(model, snap, prior_precision=1.0)
    batch = _stack(held, tgt=TGT)  # input_ids, attention_mask, labels: no decoder_input_ids
    labels = batch["labels"]
    token_ids = [3, 17, 40, 95]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       decoder_input_ids=_shift_right(model, labels)).logits.double()
    assert logits.shape[1] == TGT
    first = torch.tensor([int((row != -100).nonzero().min()) for row in labels])  # by hand
    rows = torch.arange(len(held))
    # labels: read at each row's first labelled position (where training scores first);
    # decoder inputs without labels: at the positions given (-1: the last column)
    dec = {k: batch[k] for k in ("input_ids", "attention_mask")}
    dec["decoder_input_ids"] = _shift_right(model, labels)
    for query, positions, at in (
            (batch, None, first), (dec, -1, torch.full_like(first, TGT - 1)),
            (dec, 0, torch.zeros_like(first)),
            (dec, [2, 5, 3, 0, 1, 4], torch.tensor([2, 5, 3, 0, 1, 4]))):
        mean, cov = post.predictive(query, positions=positions, token_ids=token_ids)
        want = logits[rows, at][:, token_ids]
        assert (mean - want).abs().max() <= MEAN_TOL * (1 + want.abs().max()), (family,
                                                                                 positions)
        assert cov.shape == (len(held), 4, 4) and torch.isfinite(cov).all()
        assert cov.diagonal(dim1=1, dim2=2).min() > 0
    assert sorted(batch) == ["attention_mask", "input_ids", "labels"]  # the caller's: unchanged
    # the same with decoder_input_ids given beside the labels (made by hand): the same figures
    given = dict(batch, decoder_input_ids=_shift_right(model, labels))
    m1, c1 = post.predictive(batch, token_ids=token_ids)
    m2, c2 = post.predictive(given, token_ids=token_ids)
    assert torch.equal(m1, m2) and torch.allclose(c1, c2, rtol=1e-6, atol=0)
    with pytest.raises(QueryInputError, match=r"positions=-1 is given with the batch's labels.* "
                                              r"pass decoder_input_ids"):
        post.predictive(batch, positions=-1, token_ids=token_ids)


def test_probs_and_sampled_predictive_take_labels_only(run):
    family, model, _, snap, held, _ = run
    post = LaplacePosterior(model, snap, prior_precision=1.0)
    batch = _stack(held[:3], tgt=TGT)
    probs = post.predictive_probs(batch, token_ids=[3, 17, 40])
    assert probs.shape == (3, 3) and torch.allclose(probs.sum(-1), torch.ones(3, dtype=probs.dtype))
    for linearized in (False, True):
        pred = sampled_predictive(post, batch, n_samples=2, seed=0, labels=batch["labels"],
                                  linearized=linearized)
        assert pred.probs.shape == (3, TGT, VOCAB), family  # decoder positions
        assert (pred.probs.sum(-1) - 1).abs().max() <= 1e-6
        keep = batch["labels"] != -100
        assert torch.isfinite(pred.label_logprob_mean[keep]).all()
        assert pred.label_logprob_mean[~keep].isnan().all()


def test_heldout_prior_is_fitted_on_the_eval_sets_label_tokens(run):
    family, model, _, snap, held, lines = run
    assert not [m for lvl, m in lines if "tau not fitted" in m or lvl >= logging.WARNING
                and "eval_prior" in m], lines
    prior = snap.heldout_prior
    batch = _stack(held)
    tokens = int((batch["labels"] != -100).sum())
    assert prior is not None, family
    assert math.isfinite(prior.tau) and prior.tau > 0 and prior.tau in prior.grid
    assert prior.link == "mc" and prior.examples == tokens
    assert all(math.isfinite(v) for v in prior.grid_nll)
    assert prior.nll == min(prior.grid_nll) and prior.marglik_tau in prior.grid
    # at the widest tau the posterior is nearly a point: the NLL per label token is the
    # trained model's own cross-entropy on the eval set (decoder inputs shifted by hand)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       decoder_input_ids=_shift_right(model, batch["labels"])).logits
    map_nll = float(F.cross_entropy(logits.double().reshape(-1, VOCAB),
                                    batch["labels"].reshape(-1), ignore_index=-100))
    assert list(prior.grid) == token_grid(prior.marglik_tau)  # 5 decades around it
    post = LaplacePosterior(model, snap, 1.0)
    wide = fit_prior_precision(post, [batch], grid=[1e6])
    assert wide.grid_nll[wide.grid.index(1e6)] == pytest.approx(map_nll, rel=MAP_NLL_TOL)
    # the guard per label token: MAP's own NLL is a candidate, the posterior replaces it only
    # beyond 2 paired standard errors, and the verdict says which way it went
    assert prior.map_nll == pytest.approx(map_nll, rel=MAP_OWN_TOL)
    assert prior.map_kept == (not prior.map_gain > 2 * prior.map_gain_se)
    assert prior.map_gain == pytest.approx(prior.map_nll - prior.nll, rel=1e-9, abs=1e-12)
    assert ("kept MAP's probabilities" in prior.verdict()) == prior.map_kept
    done = [m for _, m in lines if m.startswith("kfac_stream: held-out fit on")]
    assert len(done) == 1 and f"on {tokens} eval label tokens" in done[0], done
    # the method line before it names what ran: the Monte Carlo per-token fit (no answer tokens)
    said = [m for _, m in lines if m.startswith("kfac_stream: held-out fit")]
    assert "Monte Carlo over 16 draws" in said[0] and "Jacobian" not in said[0], said


def test_shared_input_probe_runs_on_a_seq2seq_model(run):
    family, _, cb, _, _, lines = run
    assert not [m for _, m in lines if "probe" in m or "not detected" in m], lines
    # q/k/v of self-attention read one tensor; so do the cross-attention's k/v (the encoder's
    # output): the probe found them. (By default both track their decoder blocks, which run
    # only with decoder inputs, which the probe builds.)
    groups = {tuple(n.rsplit(".", 1)[-1] for n in g) for g in cb.tracker.plan.groups}
    want = {("q", "k", "v"), ("k", "v")} if family == "t5" else {("k_proj", "v_proj", "q_proj"),
                                                                  ("k_proj", "v_proj")}
    assert groups == want, (family, cb.tracker.plan.groups)


def test_a_batch_with_neither_labels_nor_decoder_inputs_is_one_line_error(run):
    family, model, _, snap, held, _ = run

    post = LaplacePosterior(model, snap, prior_precision=1.0)
    bare = _stack(held[:2], ("input_ids", "attention_mask"))
    calls = {
        "predictive": lambda: post.predictive(bare, positions=-1, token_ids=[3]),
        "predictive_probs": lambda: post.predictive_probs(bare, positions=-1, token_ids=[3, 4]),
        "sampled_predictive": lambda: sampled_predictive(post, bare, n_samples=2),
    }
    for name, call in calls.items():
        with pytest.raises(QueryInputError) as err:
            call()
        msg = str(err.value)
        assert "\n" not in msg and msg.startswith(f"{name}:" if name == "sampled_predictive"
                                                  else f"LaplacePosterior.{name}:"), msg
        assert "neither 'labels' nor 'decoder_input_ids'" in msg, msg
    with pytest.raises(QueryInputError, match="no labels"):
        fit_prior_precision(post, [bare])
    # positions index the decoder's T' = 6 positions, not the encoder's 8
    dec = _stack(held[:2], ("input_ids", "attention_mask"))
    dec["decoder_input_ids"] = _shift_right(model, _stack(held[:2], tgt=TGT)["labels"])
    with pytest.raises(QueryInputError, match="outside the 6 positions"):
        post.predictive(dec, positions=7, token_ids=[3])


def test_answer_token_fit_reads_the_labels_decoder_position(run):
    """One label per row and ``token_ids``: the closed-form predictive at the label's own
    decoder position (no shift), recomputed here at every candidate tau and link (the fit's
    probit variances exact, its mean-field covariances binned: `tau_grid`)."""
    from kfac_stream.query.calibration import probs_from_gaussian
    from kfac_stream.query.tau_grid import meanfield_nll_bound

    family, model, _, snap, held, _ = run
    post = LaplacePosterior(model, snap, prior_precision=1.0)
    batch = _stack(held, ("input_ids", "attention_mask"))
    answers, at = torch.tensor([5, 6, 7, 5, 7, 6]), [1, 0, 2, 1, 0, 2]
    labels = torch.full((len(held), 3), -100)
    labels[torch.arange(len(held)), at] = answers
    prior = fit_prior_precision(post, [dict(batch, labels=labels)], token_ids=[5, 6, 7])
    assert prior.examples == len(held) and post.prior_precision == 1
    assert sorted(prior.link_nll) == ["meanfield", "probit"]
    assert prior.grid_nll == prior.link_nll[prior.link]
    dec = dict(batch, decoder_input_ids=_shift_right(model, labels))  # made by hand
    y = answers - 5
    for link, grid_nll in prior.link_nll.items():
        for tau, nll in zip(prior.grid, grid_nll):
            post.prior_precision = tau
            mean, cov = post.predictive(dec, positions=at, token_ids=[5, 6, 7])
            p = probs_from_gaussian(mean, cov, link)
            want = float(-p[torch.arange(len(held)), y].log().mean())
            if link == "probit":  # exact variances (float32 features, summed in another order)
                assert nll == pytest.approx(want, rel=1e-6), (family, link, tau)
            else:  # binned covariances: within `tau_grid`'s bound
                bound = float(meanfield_nll_bound(mean).mean())
                assert abs(nll - want) <= bound + 1e-6, (family, link, tau)


def test_the_probe_runs_on_a_bart_classifier_and_its_training(tmp_path):
    """A BART classifier reads its decoder at the end-of-sequence token of each input: the
    probe's input ends in one, so the groups are found, and a short run trains with them."""
    from transformers import BartConfig, BartForSequenceClassification, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = BartForSequenceClassification(BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=32, dropout=0.0, attention_dropout=0.0,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, num_labels=3))
    data = _examples(8, seed=3)
    for i, e in enumerate(data):
        e["input_ids"][-1] = 2  # one end-of-sequence token per example, last
        e["labels"] = torch.tensor(i % 3)
    cb = KFACStreamCallback(KFACConfig(token_fraction=1.0, update_every=1, snapshot_every=2,
                                       output_dir=str(tmp_path / "kfac")))
    args = TrainingArguments(str(tmp_path), per_device_train_batch_size=4, max_steps=2,
                             report_to=[], logging_strategy="no", save_strategy="no",
                             disable_tqdm=True, use_cpu=True, seed=0)
    Trainer(model=model, args=args, train_dataset=ListDataset(data), callbacks=[cb]).train()
    groups = {tuple(n.rsplit(".", 1)[-1] for n in g) for g in cb.tracker.plan.groups}
    assert ("k_proj", "v_proj", "q_proj") in groups, cb.tracker.plan.groups
    snap = Snapshot.load(cb.snapshots[-1])
    assert all(torch.isfinite(snap[n].A).all() for n in snap.layer_names)


def test_a_probe_that_cannot_run_says_what_it_means(caplog):
    """A model the 2-token probe cannot drive: one INFO sentence that says what it means (no
    exception text; that goes to DEBUG), and every layer keeps its own A."""
    from kfac_stream.capture.sharing import probe_shared_inputs

    class Picky(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, input_ids):
            raise ValueError("Each example must contain at least one <eos> token.")

    model = Picky()
    with caplog.at_level(logging.INFO, logger="kfac_stream"):
        assert probe_shared_inputs(model, {"q": model.q, "k": model.k}) == []
    said = [r for r in caplog.records if r.levelno == logging.INFO]
    assert len(said) == 1, [r.getMessage() for r in said]
    msg = said[0].getMessage()
    assert "keeps its own A factor" in msg and "nothing is wrong" in msg, msg
    assert "Error" not in msg and "eos" not in msg and "\n" not in msg, msg
