"""The prior precision and the link come from held-out data by default.

* With an ``eval_dataset`` the callback fits ``τ`` and the link at the end of training
  (``HeldoutConfig.prior_precision="auto"``), logs the method, then one verdict line;
  ``LaplacePosterior(model, snap)``, ``kfac-stream query`` (text and ``--json``) and
  ``kfac-stream inspect`` use and say that choice.
* Without one, the rule without held-out data (`prior_choice.NO_HELDOUT_TAU` / ``_LINK``) is
  used and said; ``"heldout"`` is refused in one line.
* The verdict says when Laplace equals MAP (``τ`` at the top of its grid).
The choice itself is checked against a brute-force grid search in test_sampling_error.py and
test_answer_tokens.py (`harness.brute_heldout_choice`).
"""

from __future__ import annotations

import json

import pytest
import torch
from test_cli_query import cli_error
from transformers import Trainer, TrainingArguments

from kfac_stream import (
    HeldoutConfig,
    KFACConfig,
    KFACConfigError,
    KFACStreamCallback,
    LaplacePosterior,
    Snapshot,
)
from kfac_stream.cli import main as cli_main
from kfac_stream.exceptions import QueryInputError
from kfac_stream.query.calibration import probs_from_gaussian
from kfac_stream.query.heldout_tau import GRID, LINKS
from kfac_stream.query.prior_choice import NO_HELDOUT_LINK
from kfac_stream.snapshot.heldout_prior import HeldoutPrior, read_heldout_prior, write_heldout_prior

from logreaders import Lines
from models import ListDataset, labelled_examples

TEXT = "def f(x):"


def _train(tmp, eval_set: bool):
    """A tiny BERT classifier trained 8 steps with the default `KFACConfig` (small sampling
    settings), with or without 12 eval examples; ``(tmp, model, snapshot, log lines)``."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=256, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=32, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    cb = KFACStreamCallback(KFACConfig(output_dir=str(tmp / "kfac"), update_every=2,
                                       min_window_sequences=0))
    args = TrainingArguments(str(tmp), per_device_train_batch_size=4,
                             per_device_eval_batch_size=4, max_steps=8, learning_rate=1e-2,
                             report_to=[], save_strategy="no", logging_strategy="no",
                             disable_tqdm=True, use_cpu=True, seed=0)
    with Lines() as log:
        Trainer(model=model, args=args, train_dataset=ListDataset(labelled_examples(24, 0)),
                eval_dataset=ListDataset(labelled_examples(12, 1)) if eval_set else None,
                callbacks=[cb]).train()
    model.save_pretrained(tmp / "model")
    return tmp, model.eval(), Snapshot.load(cb.snapshots[-1]), log.lines


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("heldout_fit"), eval_set=True)


@pytest.fixture(scope="module")
def unfitted(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("heldout_none"), eval_set=False)


def _batch(text: str = TEXT) -> dict[str, torch.Tensor]:
    ids = torch.tensor([list(text.encode())])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _query(tmp, *extra: str) -> list[str]:
    return ["query", "--snapshot", str(tmp / "kfac"), "--model", str(tmp / "model"),
            "--byte-level", "--text", TEXT, *extra]


def test_the_default_is_auto():
    assert HeldoutConfig().prior_precision == "auto"
    for bad in ("yes", 1, None):
        with pytest.raises(KFACConfigError, match=r"HeldoutConfig.prior_precision=.* must be "
                                                  r"'auto', True or False"):
            HeldoutConfig(prior_precision=bad)


def test_the_stored_choice_is_the_posteriors_default(fitted):
    _, model, snap, _ = fitted
    fit = snap.heldout_prior
    assert fit is not None and fit.examples == 12 and fit.link in LINKS
    assert fit.seconds > 0 and fit.map_nll > 0 and 0 <= fit.map_accuracy <= 1
    # the link: the fit's, or MAP's own probabilities ("map") when the guard kept them
    assert fit.probs_link == ("map" if fit.map_kept else fit.link)
    post = LaplacePosterior(model, snap)
    assert post.prior_precision == fit.tau and post.link == fit.probs_link
    assert post.prior_source == "held-out fit on 12 eval examples" == post.link_source
    assert post.heldout == fit
    assert post.describe() == (f"tau {fit.tau:.4g} (held-out fit on 12 eval examples), "
                               f"{fit.probs_link} link (held-out fit on 12 eval examples)")
    mean, cov = post.predictive(_batch())
    assert torch.equal(post.predictive_probs(_batch()),
                       probs_from_gaussian(mean, cov, fit.probs_link))
    same = LaplacePosterior(model, snap, prior_precision="heldout")
    assert (same.prior_precision, same.link) == (fit.tau, fit.probs_link)
    other = "probit" if fit.probs_link == "meanfield" else "meanfield"
    mine = LaplacePosterior(model, snap, link=other)
    assert mine.prior_precision == fit.tau and mine.link == other
    assert mine.link_source == "given"
    post.prior_precision = 3.0
    assert "tau 3 (set by hand)" in post.describe()


def test_the_stored_choice_applies_to_the_snapshots_own_layers_and_n_only(fitted):
    _, model, snap, _ = fitted
    some = snap.layer_names[:2]
    post = LaplacePosterior(model, snap, layers=some)
    ml = LaplacePosterior(model, snap, prior_precision="marglik", layers=some)
    assert post.heldout is None and post.prior_precision == ml.prior_precision
    assert post.link == NO_HELDOUT_LINK and "no held-out fit" in post.prior_source
    for kw in ({"layers": some}, {"num_data": 100.0}):
        with pytest.raises(QueryInputError, match=r"prior_precision='heldout': the stored "
                                                  r"held-out fit was made for the snapshot's "
                                                  r"own layers and N"):
            LaplacePosterior(model, snap, prior_precision="heldout", **kw)


def test_the_method_and_the_verdict_are_logged_once(fitted):
    _, _, snap, lines = fitted
    fit = snap.heldout_prior
    said = [m for m in lines if m.startswith("kfac_stream: held-out fit")]
    assert len(said) == 2, said
    assert said[0].startswith("kfac_stream: held-out fit: one Jacobian pass over the eval set")
    assert "Monte Carlo" not in said[0]
    assert said[1].startswith(f"kfac_stream: {fit.verdict()} (marginal likelihood's tau")
    assert f"vs MAP's {fit.map_nll:.4f}" in said[1]
    assert "confident by" in said[1]


def test_query_and_inspect_use_and_say_the_stored_choice(fitted, capsys):
    tmp, model, snap, _ = fitted
    fit = snap.heldout_prior
    assert cli_main(_query(tmp, "--json")) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["prior_precision"] == fit.tau and doc["link"] == fit.probs_link
    assert doc["prior_source"] == "held-out fit on 12 eval examples"
    assert doc["heldout"]["verdict"] == fit.verdict()
    post = LaplacePosterior(model, snap)
    assert doc["inputs"][0]["probs"] == pytest.approx(post.predictive_probs(_batch())[0]
                                                      .tolist(), abs=1e-6)
    assert cli_main(_query(tmp)) == 0
    footer = capsys.readouterr().out.splitlines()
    assert footer[-1] == fit.verdict()
    assert f"prior precision τ = {fit.tau:.4g} (held-out fit on 12 eval examples), " \
           f"{fit.probs_link} link (held-out fit on 12 eval examples)" in footer[-2]
    assert cli_main(_query(tmp, "--json", "--prior-precision", "marglik", "--link",
                           "probit")) == 0
    doc = json.loads(capsys.readouterr().out)
    ml = LaplacePosterior(model, snap, prior_precision="marglik", link="probit")
    assert doc["prior_source"] == "marginal likelihood" and "heldout" not in doc
    assert doc["prior_precision"] == pytest.approx(ml.prior_precision, rel=1e-12)
    assert doc["link"] == "probit" and doc["link_source"] == "given"
    assert doc["inputs"][0]["probs"] == pytest.approx(ml.predictive_probs(_batch())[0]
                                                      .tolist(), abs=1e-6)
    assert cli_main(["inspect", str(snap.path)]) == 0
    out = capsys.readouterr().out
    assert f"prior precision: {fit.verdict()} (queries use it by default)" in out.splitlines()


def test_without_an_eval_set_the_rule_is_used_and_said(unfitted, capsys):
    tmp, model, snap, lines = unfitted
    assert snap.heldout_prior is None
    said = [m for m in lines if "no eval_dataset" in m]
    assert len(said) == 1 and "queries will use the rule without held-out data (tau by " \
        f"marginal likelihood, {NO_HELDOUT_LINK} link)" in said[0], lines
    assert not [m for m in lines if m.startswith("kfac_stream: held-out fit")]
    post = LaplacePosterior(model, snap)
    ml = LaplacePosterior(model, snap, prior_precision="marglik")
    assert post.prior_precision == ml.prior_precision and post.link == NO_HELDOUT_LINK
    assert post.prior_source.startswith("marginal likelihood (no held-out fit stored")
    with pytest.raises(QueryInputError, match=r"prior_precision='heldout': no held-out fit is "
                                              r"stored beside this snapshot"):
        LaplacePosterior(model, snap, prior_precision="heldout")
    cli_error(capsys, _query(tmp, "--prior-precision", "heldout"),
              "error: LaplacePosterior: prior_precision='heldout': no held-out fit is stored")
    cli_error(capsys, _query(tmp, "--link", "softmax"), "--link='softmax' is not allowed")
    assert cli_main(_query(tmp, "--json")) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["prior_precision"] == pytest.approx(ml.prior_precision, rel=1e-12)
    assert doc["link"] == NO_HELDOUT_LINK and "heldout" not in doc
    assert cli_main(["inspect", str(snap.path)]) == 0
    assert ("prior precision: no held-out fit stored; queries use the rule without held-out "
            f"data (tau by marginal likelihood, {NO_HELDOUT_LINK} link)"
            in capsys.readouterr().out.splitlines())


def _prior(tau: float, **kw) -> HeldoutPrior:
    grid = tuple(sorted(set(GRID) | {2.5}))
    return HeldoutPrior(tau, 0.9, 2.5, 1.0, 50, "probit", grid, tuple(1.0 for _ in grid),
                        map_nll=0.95, map_accuracy=0.6, map_confidence=0.5,
                        link_nll={k: tuple(1.0 for _ in grid) for k in LINKS}, seconds=1.5,
                        **kw)


def test_the_verdict_says_when_laplace_equals_map(tmp_path):
    top = _prior(max(GRID))
    assert top.at_map and abs(top.map_gap + 0.1) < 1e-12
    assert top.verdict() == (
        "held-out fit on 50 eval examples: tau 1e+06, probit link: eval NLL 0.9000 vs MAP's "
        "0.9500; MAP underconfident by 0.100 (confidence 0.500, accuracy 0.600); Laplace = "
        "MAP here (tau at the top of its grid): use its variances for ranking and "
        "out-of-distribution scores; its probabilities equal MAP's")
    inner = _prior(2.5)
    assert not inner.at_map and "Laplace = MAP" not in inner.verdict()
    snap_dir = tmp_path / "step-00000001"
    write_heldout_prior(str(snap_dir), inner)
    assert read_heldout_prior(str(snap_dir)) == inner  # link_nll and the MAP figures too
