r"""Queries on layers that see flattened inputs: OPT's fc1/fc2 receive ``[B*T, d]``
rows, not ``[B, T, d]``.

* The exact linearised predictive of a batch equals the predictive of each example alone
  (where ``[T, d]`` rows need no split): the batch-major split of ``[B*T, d]`` is right.
* The sampled linearised predictive over the whole vocabulary at ``S = 4000`` agrees with the
  exact one: the covariance's relative Frobenius error is within `MC_Z` Monte-Carlo standard
  errors, the error estimated from the samples themselves.

  With the mean known (the linearised samples are ``f* + J δ_s``, ``δ_s ~ N(0, Σ_post)``, so
  ``E f_s = f*`` exactly), ``Ĉ = (1/S) Σ_s (f_s − f*)(f_s − f*)ᵀ`` is unbiased for ``C`` and
  Wishart: ``Var Ĉ_ij = (C_ij² + C_ii C_jj) / S``, hence
  ``E ||Ĉ − C||_F² = (||C||_F² + tr(C)²) / S`` and the standard error of the relative error is
  ``se = sqrt((||Ĉ||_F² + tr(Ĉ)²) / S) / ||Ĉ||_F`` (``Ĉ`` for ``C``).
* A layout that cannot be split by example raises one clear `UnsupportedLayoutError`.
"""

from __future__ import annotations

import math

import pytest
import torch

from kfac_stream import LaplacePosterior, Snapshot, UnsupportedLayoutError
from kfac_stream.query.per_example import per_example_inputs
from kfac_stream.query.sampled import sampled_predictive

from harness import run
from models import text_examples, tiny_opt

#: float64 model end to end: per-example and batched features differ by round-off only.
ROUNDOFF_TOL = 1e-10
#: The sampled predictive's bound: within 4 Monte-Carlo standard errors.
MC_Z = 4.0
MC_SAMPLES = 4000
VOCAB = 256


@pytest.fixture(scope="module")
def opt_post(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("opt")
    model = tiny_opt()
    run(model, text_examples(8, 12), {"token_fraction": 0.5}, tmp_path=tmp, record=False)
    snap = Snapshot.latest(tmp / "kfac")
    assert any(n.endswith("fc1") for n in snap.layer_names)
    return LaplacePosterior(model.eval(), snap, prior_precision="marglik")


def _batch(n: int, length: int) -> dict[str, torch.Tensor]:
    ex = text_examples(n, length, seed=5)
    return {"input_ids": torch.stack([e["input_ids"] for e in ex])}


def test_batched_predictive_equals_each_example_alone(opt_post):
    batch = _batch(3, 10)
    ids = [5, 32, 101, 200]
    mean, cov = opt_post.predictive(batch, positions=-1, token_ids=ids)
    for b in range(3):
        one = {"input_ids": batch["input_ids"][b:b + 1]}
        m1, c1 = opt_post.predictive(one, positions=-1, token_ids=ids)
        assert (mean[b] - m1[0]).abs().max() <= ROUNDOFF_TOL
        assert (cov[b] - c1[0]).abs().max() <= ROUNDOFF_TOL * cov[b].abs().max()


def test_sampled_linearised_covariance_within_4_mc_errors_of_the_exact(opt_post):
    batch = _batch(1, 8)
    mean, cov = opt_post.predictive(batch, positions=-1, token_ids=list(range(VOCAB)))
    pred = sampled_predictive(opt_post, batch, n_samples=MC_SAMPLES, seed=0, linearized=True,
                              return_logits=True)
    f = pred.sample_logits[:, 0, -1].double()  # [S, V] at the last position
    d = f - mean[0]
    emp = d.T @ d / MC_SAMPLES  # [V, V], mean known
    c = cov[0]
    err = float((emp - c).norm() / c.norm())
    se = math.sqrt((float(emp.norm()) ** 2 + float(emp.trace()) ** 2) / MC_SAMPLES) \
        / float(emp.norm())
    print(f"OPT, V={VOCAB}, S={MC_SAMPLES}: covariance relative Frobenius error {err:.4f}, "
          f"MC standard error {se:.4f}, ratio {err / se:.2f} (bound {MC_Z})")
    assert err <= MC_Z * se, (err, se)
    # the bound can fail: the exact covariance of twice the prior precision is far outside it
    wide = opt_post.predictive_covariances(
        batch, -1, list(range(VOCAB)), prior_precisions=[2 * opt_post.prior_precision])[1][0, 0]
    assert float((emp - wide).norm() / wide.norm()) > MC_Z * se


@pytest.mark.parametrize("shape", [(7, 3, 16), (3, 4, 5, 16)])  # [T, B, d]; [T, B, ...]
def test_layout_that_cannot_be_split_by_example_is_refused(shape):
    with pytest.raises(UnsupportedLayoutError, match=r"layer 'h.0.fc' receives its input as "
                       r"\[7, 3, 16\]|\[3, 4, 5, 16\]"):
        per_example_inputs("LaplacePosterior", "h.0.fc", torch.zeros(shape), 2)
    rows = torch.arange(2 * 5 * 4.0).reshape(10, 4)  # [B*T, d] batch-major
    assert torch.equal(per_example_inputs("q", "x", rows, 2)[1], rows[5:])


def test_answers_and_presets_on_flattened_layers(opt_post):
    """`answer_distribution` (linearised samples: the Jacobian of every layer, fc1/fc2 too)
    and a preset posterior over the MLP layers alone (fc1/fc2, the flattened ones)."""
    from kfac_stream import answer_distribution

    batch = _batch(2, 8)
    dist = answer_distribution(opt_post, batch, options=[5, 32, 101], n_samples=8,
                               linearized=True)
    assert dist.probs.shape == (2, 3) and torch.allclose(dist.probs.sum(-1),
                                                          torch.ones(2, dtype=dist.probs.dtype))
    mlp = LaplacePosterior(opt_post.model, opt_post.snapshot, layers="mlp")
    assert mlp.layer_names and all(n.endswith(("fc1", "fc2")) for n in mlp.layer_names)
    mean, cov = mlp.predictive(batch, positions=-1, token_ids=[5, 32])
    assert cov.shape == (2, 2, 2) and bool((cov.diagonal(dim1=1, dim2=2) > 0).all())
