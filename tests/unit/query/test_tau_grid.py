"""The held-out fit's fast path (`kfac_stream.query.tau_grid`) against the
exact per-``τ`` covariances (`LaplacePosterior.predictive_covariances`, every candidate
recomputed over all weights).

* The variances (all the probit link reads) are exact: equal to the exact path's to float64
  rounding, so probit's per-``τ`` NLLs agree to 1e-9.
* The binned ``K × K`` covariances (the mean-field link) are within the stated bound, derived
  from the bin width ``w``: each pair stands at its bin's log-centre, within ``e^{±w/2}`` of
  its eigenvalue, and ``1/(λ + τ)`` moves by at most the factor ``λ`` does, so every variance
  and every variance of a logit difference is within ``e^{±w/2}`` (`tau_grid.VARIANCE_FACTOR`)
  of the exact one, and each example's mean-field NLL within
  `tau_grid.meanfield_nll_bound` of it. The binning is at work (the covariances differ).
* The fit chooses the same ``τ``, link and MAP-or-posterior as a brute-force search over the
  exact covariances (`harness.brute_heldout_choice`).
* The K logit backwards (a loop or one batched backward) give each tracked weight's gradient.
* The features (each factor rotated before or after the sum over positions, positions
  without gradient dropped) equal their definition, ``M[b, k] = Q_Gᵀ (Σ_t g a_tᵀ) Q_A``.
"""

from __future__ import annotations

import math

import pytest
import torch

from kfac_stream.query import per_example, tau_grid
from kfac_stream.query.calibration import probs_from_gaussian
from kfac_stream.query.heldout_tau import GRID, fit_prior_precision

from harness import brute_heldout_choice, run
from models import text_examples

K = 4  # classes


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """``(posterior, eval batch, labels [B], candidate taus)`` of a 1-block float64 GPT-2
    classifier trained 15 epochs on 128 12-token windows labelled by their first byte mod 4,
    and 24 held-out windows (MAP overconfident there: the fit picks an interior tau, and the
    mean-field link's best lies at another tau than probit's)."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    from kfac_stream import LaplacePosterior, Snapshot

    tmp = tmp_path_factory.mktemp("grid")
    torch.manual_seed(0)
    model = GPT2ForSequenceClassification(GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=256, n_positions=64, num_labels=K,
        pad_token_id=0, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)).double()
    train = text_examples(128, 12, seed=3)
    for e in train:
        e["labels"] = e["input_ids"][0] % K
    run(model, train, {"update_every": 20}, batch=8, epochs=15, lr=3e-2, tmp_path=tmp,
        record=False)
    model.eval()
    post = LaplacePosterior(model, Snapshot.latest(tmp / "kfac"), 1.0)
    held = text_examples(24, 12, seed=7)
    batch = {k: torch.stack([e[k] for e in held]) for k in ("input_ids", "attention_mask")}
    # a shift: one in eight held-out labels moved to the next class, so MAP is overconfident
    y = torch.stack([(e["input_ids"][0] + (i % 8 == 0)) % K for i, e in enumerate(held)])
    taus = sorted(set(GRID) | {post.optimize_prior_precision(show_progress=False)})
    post.prior_precision = 1.0
    return post, batch, y, taus


def _nll(mean, cov, link, y):
    """``[B]`` NLL of the labels under ``link``."""
    return -probs_from_gaussian(mean, cov, link)[torch.arange(len(y)), y].log()


def _difference_variances(cov):
    """``[..., K, K]``: ``Var(f_k − f_l) = Σ_kk + Σ_ll − 2 Σ_kl``."""
    var = torch.diagonal(cov, dim1=-2, dim2=-1)
    return var[..., :, None] + var[..., None, :] - 2.0 * cov


def test_both_paths_are_exercised(fitted):
    """The batch has layers of rank one (one position with a gradient: the last block's
    attention output and MLP, read at the last token) and layers with features."""
    post, batch, _, _ = fitted
    q = post._query("test", batch, None, None)
    _, per_call = per_example.layer_gradients(post.model, post.modules, q)
    kept = {n: tau_grid.kept_positions(a, g, True, torch.float64)[0].shape[1]
            for n, [(a, g)] in per_call.items()}
    assert min(kept.values()) == 1 and max(kept.values()) == 12, kept


def test_the_variances_are_exact_and_the_covariances_within_the_bound(fitted):
    post, batch, y, taus = fitted
    mean, covs = post.covariance_grid(batch, prior_precisions=taus,
                                      links=("probit", "meanfield"))
    ref_mean, ref = post.predictive_covariances(batch, prior_precisions=taus)
    assert torch.equal(mean, ref_mean)
    exact_var = torch.diagonal(ref, dim1=-2, dim2=-1)  # [P, B, K]
    probit = covs["probit"]
    torch.testing.assert_close(torch.diagonal(probit, dim1=-2, dim2=-1), exact_var,
                               rtol=1e-10, atol=0)
    assert not probit[..., ~torch.eye(K, dtype=torch.bool)].any()  # the diagonal only
    # the binned K x K: every variance, and every variance of a difference, within the bound
    binned = covs["meanfield"]
    log_var = (torch.diagonal(binned, dim1=-2, dim2=-1) / exact_var).log().abs()
    off = ~torch.eye(K, dtype=torch.bool)
    log_diff = (_difference_variances(binned)[..., off] /
                _difference_variances(ref)[..., off]).log().abs()
    bound = math.log(tau_grid.VARIANCE_FACTOR) + 1e-9
    assert float(log_var.max()) <= bound and float(log_diff.max()) <= bound
    assert float(log_var.max()) > 1e-6  # the binning is at work: not exact by accident
    for i in range(len(taus)):  # the per-tau NLLs
        torch.testing.assert_close(_nll(mean, probit[i], "probit", y),
                                   _nll(mean, ref[i], "probit", y), rtol=1e-9, atol=0)
        moved = (_nll(mean, binned[i], "meanfield", y) - _nll(mean, ref[i], "meanfield", y))
        assert bool((moved.abs() <= tau_grid.meanfield_nll_bound(mean) + 1e-12).all())
    # probit alone: only its exact variances
    _, alone = post.covariance_grid(batch, prior_precisions=taus, links=("probit",))
    assert set(alone) == {"probit"} and torch.equal(alone["probit"], probit)


def test_the_fit_chooses_what_the_exact_covariances_choose(fitted):
    post, batch, y, _ = fitted
    fit = fit_prior_precision(post, [dict(batch, labels=y)])
    (tau, link), brute, kept = brute_heldout_choice(post, fit.grid,
                                                    lambda: post.predictive(batch), y)
    post.prior_precision = 1.0
    assert (fit.tau, fit.link, fit.map_kept) == (tau, link, kept)
    assert min(fit.grid) < fit.tau < max(fit.grid)  # an interior choice: not trivial
    for t, value in zip(fit.grid, fit.link_nll["probit"]):
        assert value == pytest.approx(brute[(t, "probit")], rel=1e-9)


def test_the_logit_gradients_give_each_weights_gradient(fitted):
    """Both ways of taking the K backwards (one batched backward, a loop of K) give
    ``Σ_{b,t} g_k ā_tᵀ`` equal to autograd's gradient of ``Σ_b f[b, k]`` with respect to each
    tracked weight (and bias), and equal each other (float64: to 1e-12, the round-off of
    differently ordered sums)."""
    post, batch, _, _ = fitted
    q = post._query("test", batch, None, None)
    with per_example.layer_calls(post.modules) as calls, torch.enable_grad():
        f = per_example.select_logits(post.model(**batch).logits, q)  # [B, K]
        names = list(calls)
        outs = [calls[n][0][1] for n in names]
        params = [p for n in names for p in (post.modules[n].weight, post.modules[n].bias)]
        ref = [torch.autograd.grad(f[:, k].sum(), params, retain_graph=True) for k in range(K)]
        batched = per_example.logit_gradients(f, outs, True)
        assert batched[0][0]._base is not None  # views of one batched backward: it ran
        loop = per_example.logit_gradients(f, outs, False)  # frees the graph
    for grads in (batched, loop):
        assert len(grads) == len(outs) and all(len(g) == K for g in grads)
        for k in range(K):
            for i, n in enumerate(names):
                a = calls[n][0][0].reshape(-1, calls[n][0][0].shape[-1])  # [B·T, d_in]
                g = grads[i][k].reshape(len(a), -1)  # [B·T, d_out]
                weight, bias = ref[k][2 * i], ref[k][2 * i + 1]
                conv1d = type(post.modules[n]).__name__ == "Conv1D"  # weight [d_in, d_out]
                want = weight if conv1d else weight.T
                torch.testing.assert_close(a.T @ g, want, rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(g.sum(0), bias, rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(grads[i][k], loop[i][k], rtol=1e-12, atol=1e-12)


# (positions, d_in, d_out): which factor is rotated before the sum over positions (d_A =
# d_in + 1 with the bias): both; neither; A only (d_A < T ≤ K·d_out); G only (K·d_out < T ≤
# d_A)
@pytest.mark.parametrize("positions,d_in,d_out", [(3, 5, 6), (40, 5, 6), (10, 5, 6),
                                                  (20, 29, 6)])
@pytest.mark.parametrize("diagonal_a", [False, True])  # Q_A None: a diagonal A factor
def test_the_features_equal_their_definition(positions, d_in, d_out, diagonal_a):
    gen = torch.Generator().manual_seed(positions)
    B, Kc = 3, 2
    a = torch.randn(B, positions, d_in, generator=gen, dtype=torch.float64)
    g = torch.randn(Kc, B, positions, d_out, generator=gen, dtype=torch.float64)
    g[:, :, 1] = 0.0  # no logit has a gradient there: dropped, adds nothing
    qa = None if diagonal_a else torch.linalg.qr(
        torch.randn(d_in + 1, d_in + 1, generator=gen, dtype=torch.float64))[0]
    qg = torch.linalg.qr(torch.randn(d_out, d_out, generator=gen, dtype=torch.float64))[0]
    ka, kg = tau_grid.kept_positions(a, g, True, torch.float64)
    assert ka.shape[1] == kg.shape[2] == positions - 1
    abar = torch.cat([a, torch.ones(B, positions, 1, dtype=torch.float64)], -1)
    want = torch.einsum("kbti,btj->bkij", g @ qg, abar if qa is None else abar @ qa)
    torch.testing.assert_close(tau_grid.layer_features(ka, kg, qa, qg), want,
                               rtol=1e-12, atol=1e-12)
