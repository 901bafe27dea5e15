"""The held-out fit's guard (`heldout_tau.GUARD_SE`): MAP's own probabilities are a
candidate; the posterior replaces them only when its eval NLL beats MAP's by more than 2 paired
standard errors of the per-example differences, and a link other than probit is chosen only
beyond 2 such errors. Checked on constructed per-example NLLs (the rule at its boundary, the
paired s.e. against `statistics` / numpy) and on a tiny trained classifier whose eval labels
make each outcome certain, through the stored file, ``LaplacePosterior(model, snap)`` and the
verdict line.
"""

from __future__ import annotations

import json
import math
import statistics

import numpy as np
import pytest
import torch

from kfac_stream import LaplacePosterior, Snapshot
from kfac_stream.query.calibration import probs_from_gaussian
from kfac_stream.query.heldout_tau import (
    BASE_LINK,
    GUARD_SE,
    fit_prior_precision,
    guarded_choice,
    paired_gain,
)
from kfac_stream.query.prior_choice import NO_HELDOUT_LINK, NO_HELDOUT_TAU
from kfac_stream.snapshot.heldout_prior import (
    SIDECAR,
    HeldoutPrior,
    read_heldout_prior,
    write_heldout_prior,
)

from models import text_examples, tiny_classifier_run

TAUS = [0.1, 1.0, 10.0]


def _independent_gain(base, other) -> tuple[float, float]:
    """Mean and paired s.e. of ``base − other`` by `statistics` (sample sd, n − 1)."""
    diff = [float(a) - float(b) for a, b in zip(base, other)]
    return statistics.fmean(diff), statistics.stdev(diff) / math.sqrt(len(diff))


def test_the_rule_is_fixed_in_code():
    assert GUARD_SE == 2.0 and BASE_LINK == "probit"
    assert (NO_HELDOUT_TAU, NO_HELDOUT_LINK) == ("marglik", "probit")


def test_paired_gain_against_statistics_and_numpy():
    gen = torch.Generator().manual_seed(0)
    base = torch.rand(37, generator=gen, dtype=torch.float64) * 3
    other = base - 0.1 + 0.2 * torch.rand(37, generator=gen, dtype=torch.float64)
    gain, se = paired_gain(base, other)
    ref_gain, ref_se = _independent_gain(base, other)
    d = (base - other).numpy()
    assert gain == pytest.approx(ref_gain, rel=1e-12)
    assert se == pytest.approx(ref_se, rel=1e-12)
    assert se == pytest.approx(np.std(d, ddof=1) / np.sqrt(len(d)), rel=1e-12)
    # one example: no standard error, so no gain is beyond noise
    g1, se1 = paired_gain(torch.tensor([2.0]), torch.tensor([1.0]))
    assert g1 == 1.0 and math.isnan(se1)
    one = guarded_choice({"probit": torch.tensor([[1.0]])}, torch.tensor([2.0]), [1.0])
    assert one.map_kept


def _vectors(t_stat: float, n: int = 50, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a [n], b [n])`` with ``b`` better than ``a`` by exactly ``t_stat`` paired s.e."""
    gen = torch.Generator().manual_seed(seed)
    a = 0.5 + torch.rand(n, generator=gen, dtype=torch.float64)
    noise = torch.randn(n, generator=gen, dtype=torch.float64)
    noise = (noise - noise.mean()) / noise.std()  # mean 0, sd 1 exactly
    diff = 0.1 * noise + 0.1 * t_stat / math.sqrt(n)  # [n]: mean / (sd / sqrt n) = t_stat
    return a, a - diff


@pytest.mark.parametrize("t_stat, kept", [(1.0, True), (1.9, True), (2.1, False), (5.0, False)])
def test_the_posterior_replaces_map_only_beyond_two_paired_standard_errors(t_stat, kept):
    map_nll, post_nll = _vectors(t_stat)
    # probit's candidates: the best one (tau 1) is post_nll; the others are worse
    probit = torch.stack([post_nll + 0.3, post_nll, post_nll + 0.1])  # [3, n]
    c = guarded_choice({"probit": probit}, map_nll, TAUS)
    assert (c.link, c.index) == ("probit", 1) and c.map_kept is kept
    gain, se = _independent_gain(map_nll, post_nll)
    assert c.map_gain == pytest.approx(gain, rel=1e-12) and gain > 0
    assert c.map_gain_se == pytest.approx(se, rel=1e-12)
    assert c.map_gain / c.map_gain_se == pytest.approx(t_stat, rel=1e-9)


@pytest.mark.parametrize("t_stat, link", [(1.5, "probit"), (1.99, "probit"), (2.01, "meanfield"),
                                          (4.0, "meanfield")])
def test_a_link_other_than_probit_is_chosen_only_beyond_two_paired_standard_errors(t_stat, link):
    probit_best, meanfield_best = _vectors(t_stat, seed=1)
    per_example = {"probit": torch.stack([probit_best + 0.2, probit_best + 0.1, probit_best]),
                   "meanfield": torch.stack([meanfield_best, meanfield_best + 0.4,
                                             meanfield_best + 0.5])}
    map_nll = probit_best + 5.0  # MAP far worse than either: the posterior is chosen
    c = guarded_choice(per_example, map_nll, TAUS)
    assert c.link == link and c.index == (2 if link == "probit" else 0)
    assert not c.map_kept
    gain, se = _independent_gain(probit_best, meanfield_best)
    assert c.link_gain["meanfield"] == pytest.approx((gain, se), rel=1e-12)
    # probit is the base even when it is listed second
    swapped = guarded_choice({"meanfield": per_example["meanfield"],
                              "probit": per_example["probit"]}, map_nll, TAUS)
    assert swapped.link == link


def test_ties_of_the_mean_nll_go_to_the_larger_tau():
    v = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    c = guarded_choice({"probit": torch.stack([v, v + 1, v])}, v + 1.0, TAUS)
    assert c.index == 2


# -- a tiny trained classifier -----------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The 4-class float64 GPT-2 classifier of `models.tiny_classifier_run` and 24 eval inputs
    (byte windows the model was not trained on) with MAP's logits on them."""
    tmp = tmp_path_factory.mktemp("guard")
    model, snap, _ = tiny_classifier_run(tmp)
    model.eval()
    ex = text_examples(24, 12, seed=7)
    batch = {k: torch.stack([e[k] for e in ex]) for k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        logits = model(**batch).logits  # [24, 4]
    return model, snap, batch, logits


def _refit(model, snap, batch, y) -> tuple[HeldoutPrior, LaplacePosterior]:
    """Fit on ``batch`` with labels ``y [n]``, store the fit beside the snapshot, reload it
    and build the default posterior from the reloaded snapshot."""
    post = LaplacePosterior(model, snap, prior_precision=1.0)
    fit = fit_prior_precision(post, [dict(batch, labels=y)])
    write_heldout_prior(str(snap.path), fit)
    again = Snapshot.load(snap.path)
    assert again.heldout_prior == fit  # the guard's fields survive the file
    return fit, LaplacePosterior(model, again)


def _by_hand(post, batch, fit, y):
    """The guard recomputed from the posterior's predictive: per-example NLLs of the stored
    link at every grid ``τ`` and of MAP's softmax, then `statistics`."""
    rows = []
    for tau in fit.grid:
        post.prior_precision = tau
        mean, cov = post.predictive(batch)
        p = probs_from_gaussian(mean, cov, fit.link)
        rows.append((-p[torch.arange(len(y)), y].log()).tolist())
    means = [statistics.fmean(r) for r in rows]
    best = min(range(len(rows)), key=lambda i: (means[i], -fit.grid[i]))
    p_map = torch.softmax(mean.double(), -1)
    map_nll = (-p_map[torch.arange(len(y)), y].log()).tolist()
    return best, map_nll, rows[best]


def test_a_gain_within_noise_keeps_maps_probabilities(trained):
    """16 of the 24 eval examples labelled with MAP's least likely class, the other 8 with its
    most likely: the flattest posterior helps the 16 and costs the 8; its mean gain is real
    (0.033 nats) but 1.4 paired s.e. (measured on this model: 18 of 24 give 2.5 s.e.)."""
    model, snap, batch, logits = trained
    y = logits.argmax(-1)
    y[:16] = logits[:16].argmin(-1)
    fit, post = _refit(model, snap, batch, y)
    assert fit.map_kept and fit.probs_link == "map" and fit.at_map
    best, map_nll, post_nll = _by_hand(post, batch, fit, y)
    gain, se = _independent_gain(map_nll, post_nll)
    assert fit.grid[best] == fit.tau and fit.link == "probit"
    assert fit.map_gain == pytest.approx(gain, rel=1e-6, abs=1e-12)
    assert fit.map_gain_se == pytest.approx(se, rel=1e-6)
    assert 0.01 < gain < GUARD_SE * se  # a real gain, within noise
    assert fit.map_nll == pytest.approx(statistics.fmean(map_nll), rel=1e-12)
    # the default posterior: MAP's probabilities exactly, the fitted tau for its variances
    post = LaplacePosterior(model, Snapshot.load(snap.path))
    assert post.link == "map" and post.prior_precision == fit.tau
    assert post.link_source == f"held-out fit on {len(y)} eval examples"
    assert torch.equal(post.predictive_probs(batch), torch.softmax(logits, -1))
    assert f"{fit.tau:.4g} (held-out fit" in post.describe() and "map link" in post.describe()
    verdict = fit.verdict()
    assert verdict.startswith(f"held-out fit on 24 eval examples: kept MAP's probabilities: the "
                              f"posterior's eval gain {gain:.3g} ± {se:.2g} nats (tau "
                              f"{fit.tau:.4g}, probit link) is within noise (2 paired s.e.); its "
                              "variances still rank and flag out-of-distribution inputs; eval "
                              f"NLL {fit.nll:.4f} vs MAP's {fit.map_nll:.4f}")
    assert "meanfield link not chosen" in verdict and "\n" not in verdict


def test_a_clear_gain_switches_to_the_posterior(trained):
    """Every eval example labelled with MAP's least likely class: flattening helps each one."""
    model, snap, batch, logits = trained
    y = logits.argmin(-1)
    fit, post = _refit(model, snap, batch, y)
    assert not fit.map_kept and fit.probs_link == fit.link and not fit.at_map
    best, map_nll, post_nll = _by_hand(post, batch, fit, y)
    gain, se = _independent_gain(map_nll, post_nll)
    assert fit.grid[best] == fit.tau
    assert fit.map_gain == pytest.approx(gain, rel=1e-6)
    assert fit.map_gain_se == pytest.approx(se, rel=1e-6)
    assert gain > GUARD_SE * se
    lg, lse = fit.link_gain["meanfield"]  # the link: probit unless mean-field won beyond noise
    assert (fit.link == "meanfield") == (lg > GUARD_SE * lse)
    post = LaplacePosterior(model, Snapshot.load(snap.path))
    assert post.link == fit.link and post.prior_precision == fit.tau
    mean, cov = post.predictive(batch)
    assert torch.equal(post.predictive_probs(batch), probs_from_gaussian(mean, cov, fit.link))
    assert not torch.allclose(post.predictive_probs(batch), torch.softmax(logits, -1))
    assert fit.verdict().startswith(
        f"held-out fit on 24 eval examples: the posterior's probabilities (tau {fit.tau:.4g}, "
        f"{fit.link} link): its eval gain over MAP {gain:.3g} ± {se:.2g} nats is beyond noise "
        "(more than 2 paired s.e.)")


def test_a_file_from_before_the_guard_is_read_as_it_was(tmp_path):
    """A sidecar without the guard's fields: its tau and link are used as they are."""
    old = {"tau": 10.0, "nll": 0.5, "marglik_tau": 3.0, "marglik_nll": 0.6, "examples": 40,
           "link": "meanfield", "grid": [1.0, 3.0, 10.0], "grid_nll": [0.7, 0.6, 0.5],
           "map_nll": 0.55, "map_accuracy": 0.8, "map_confidence": 0.9,
           "link_nll": {"probit": [0.8, 0.7, 0.6], "meanfield": [0.7, 0.6, 0.5]},
           "seconds": 1.0}
    snap_dir = tmp_path / "step-00000001"
    (tmp_path / ("step-00000001" + SIDECAR)).write_text(json.dumps(old))
    fit = read_heldout_prior(str(snap_dir))
    assert fit is not None and not fit.map_kept and fit.map_gain is None
    assert (fit.tau, fit.link, fit.probs_link) == (10.0, "meanfield", "meanfield")
    assert fit.verdict().startswith("held-out fit on 40 eval examples: tau 10, meanfield link: "
                                    "eval NLL 0.5000 vs MAP's 0.5500")


def test_verdict_words_a_loss_beyond_noise_as_a_loss():
    """MAP kept because the posterior lost by far more than the guard's width: the verdict
    says it lost, not that its gain is within noise."""
    from kfac_stream.snapshot.heldout_prior import HeldoutPrior

    common = dict(tau=1e-4, nll=772.0, marglik_tau=1e-6, marglik_nll=800.0, examples=2048,
                  link="probit", grid=(1e-4,), grid_nll=(772.0,), map_nll=2.09,
                  map_accuracy=0.5, map_confidence=0.45, map_kept=True)
    lost = HeldoutPrior(**common, map_gain=-770.0, map_gain_se=18.0).verdict()
    assert "eval gain -770 ± 18 nats (tau 0.0001, probit link) is a loss beyond noise: worse " \
        "than MAP; its variances" in lost
    near = HeldoutPrior(**common, map_gain=-0.03, map_gain_se=0.02).verdict()
    assert "is within noise (2 paired s.e.)" in near  # -0.03 > -2 × 0.02
