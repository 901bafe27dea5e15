"""Probabilities and scores from a Gaussian over logits, and the search they are tuned with.

`probs_from_gaussian`: the K-way link (probit, mean-field, Monte Carlo) of ``f ~ N(μ, Σ)``;
`fit_confidence_beta`: ``β`` of the confidence score ``1 / (1 + β·var)``;
`minimise_over_log_range`: the log-spaced grid and golden-section search that choose ``β`` and
the marginal-likelihood ``τ`` (`LaplacePosterior.optimize_prior_precision`, on the surrogate of
`kfac_stream.query.marglik`)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from . import inputs

#: The K-way links: three of the Gaussian, and ``"map"``, MAP's own ``softmax(μ)`` (the
#: covariance unused: the default probabilities of a posterior whose held-out fit kept MAP,
#: `kfac_stream.query.heldout_tau`).
PROBS_METHODS = ("probit", "meanfield", "mc", "map")


def probs_from_gaussian(mean: Tensor, cov: Tensor, method: str = "meanfield",
                        n_samples: int = 1000, seed: int = 0) -> Tensor:
    """K-way softmax probabilities under ``f ~ N(mean, cov)``.

    Args:
        mean: ``[B, K]`` floating tensor.
        cov: ``[B, K, K]`` floating tensor.
        method: ``"meanfield"`` (default), ``"probit"``, ``"mc"`` or ``"map"`` (``softmax(mean)``,
            MAP's own probabilities; ``cov`` unused) (as in `LaplacePosterior.predictive_probs`).
        n_samples: Draws for ``"mc"``, an int ≥ 1.
        seed: Seed of the draws, an int.

    Returns:
        ``[B, K]``.

    The probit link scales each logit by its own variance and ignores the covariances: where
    the K logits move together (answer logits read from one shared representation), it
    flattens and can reorder the probabilities although no logit *difference* is uncertain.
    ``"meanfield"`` is the pairwise mean-field approximation of Lu, Ie & Sha (2020,
    arXiv:2006.07584): with ``Δ_kj = μ_k − μ_j`` and ``s²_kj = Σ_kk + Σ_jj − 2Σ_kj``,
    ``p_k ∝ 1 / Σ_j exp(−Δ_kj / sqrt(1 + π/8 · s²_kj))`` (the ``j = k`` term is 1),
    normalised over k. A noise shared by all logits leaves it at ``softmax(μ)``, and for
    K = 2 it is the probit approximation of the sigmoid of the difference (so it keeps the
    MAP's decision there). It is the default because on the LoRA multiple-choice benchmark
    (``benchmarks/uncertainty_classification.py``, 3 seeds) probit changed 22% of MAP's
    decisions and cost 2.9 points of accuracy, the mean-field link 8% and none (+1.3 points),
    with a lower NLL (1.235 vs 1.327); see ``benchmarks/RESULTS.md``.
    """
    where = "probs_from_gaussian"
    inputs.check_choice(where, "method", method, PROBS_METHODS)
    if not isinstance(mean, Tensor) or not mean.is_floating_point() or mean.dim() != 2:
        raise inputs.error(where, "mean", mean, "a [B, K] floating tensor",
                           typed=not isinstance(mean, Tensor))
    if not isinstance(cov, Tensor) or not cov.is_floating_point() or tuple(cov.shape) != (
            *mean.shape, mean.shape[-1]):
        raise inputs.error(where, "cov", cov, f"a [B, K, K] = {[*mean.shape, mean.shape[-1]]} "
                           "floating tensor (mean is [B, K])", typed=not isinstance(cov, Tensor))
    n_samples = inputs.check_int(where, "n_samples", n_samples, 1)
    seed = inputs.check_seed(where, "seed", seed)
    if method == "map":
        return torch.softmax(mean, dim=-1)
    if method == "probit":
        kappa = 1.0 / torch.sqrt(1.0 + math.pi / 8.0 * torch.diagonal(cov, dim1=-2, dim2=-1))
        return torch.softmax(mean * kappa, dim=-1)
    if method == "meanfield":
        var = torch.diagonal(cov, dim1=-2, dim2=-1)  # [B, K]
        diff_var = (var[:, :, None] + var[:, None, :] - 2.0 * cov).clamp(min=0.0)  # [B, K, K]
        diff = mean[:, :, None] - mean[:, None, :]  # [B, K, K]: Δ_kj
        # −log p_k (unnormalised) = logsumexp_j(−Δ_kj / sqrt(1 + π/8 s²_kj)); diagonal: 0
        score = -torch.logsumexp(-diff / torch.sqrt(1.0 + math.pi / 8.0 * diff_var), dim=-1)
        return torch.softmax(score, dim=-1)
    gen = torch.Generator().manual_seed(seed)
    k = mean.shape[-1]
    jitter = 1e-10 * torch.diagonal(cov, dim1=-2, dim2=-1).mean(-1).clamp(min=1e-30)
    chol = torch.linalg.cholesky(cov + jitter[:, None, None] * torch.eye(k, dtype=cov.dtype))
    z = torch.randn(n_samples, *mean.shape, generator=gen, dtype=mean.dtype)  # [S, B, K]
    f = mean + torch.einsum("bkl,sbl->sbk", chol, z)
    return torch.softmax(f, dim=-1).mean(0)


def fit_confidence_beta(variances: Tensor, correct: Tensor, lower: float = 1e-8,
                        upper: float = 1e8) -> float:
    """``β ≥ 0`` minimising the binary cross-entropy of ``1/(1+β·var)`` against correctness.

    Args:
        variances: ``[n]`` predictive variances (≥ 0), ``n ≥ 1``.
        correct: ``[n]`` bool, whether each prediction was right.
        lower, upper: The range of ``β``, finite with ``0 < lower < upper``.

    Returns:
        The minimiser over a log-spaced grid on ``[lower, upper]`` refined by golden section.
    """
    where = "fit_confidence_beta"
    if not isinstance(variances, Tensor) or variances.dim() != 1 or variances.numel() == 0:
        raise inputs.error(where, "variances", variances, "a [n] tensor with n >= 1",
                           typed=not isinstance(variances, Tensor))
    if not isinstance(correct, Tensor) or tuple(correct.shape) != tuple(variances.shape):
        raise inputs.error(where, "correct", correct,
                           f"a [n] = {list(variances.shape)} bool tensor like variances",
                           typed=not isinstance(correct, Tensor))
    lower, upper = check_range(where, lower, upper)
    v = variances.double().clamp(min=0.0)
    y = correct.double()

    def nll(log_beta: float) -> float:
        conf = (1.0 / (1.0 + math.exp(log_beta) * v)).clamp(1e-12, 1 - 1e-12)
        return -float((y * conf.log() + (1 - y) * (1 - conf).log()).mean())

    return minimise_over_log_range(nll, lower, upper, grid=161, iters=80)


def check_range(where: str, lower: object, upper: object) -> tuple[float, float]:
    """``(lower, upper)`` as floats, finite with ``0 < lower < upper``."""
    allowed = "a finite float with 0 < lower < upper"
    lo = inputs.check_positive(where, "lower", lower, allowed)
    hi = inputs.check_positive(where, "upper", upper, allowed)
    if not lo < hi:
        raise inputs.error(where, "upper", upper, allowed, problem=f"is not above lower={lo!r}")
    return lo, hi


def minimise_over_log_range(f: Callable[[float], float], lower: float, upper: float,
                             grid: int, iters: int) -> float:
    """``x`` in ``[lower, upper]`` minimising ``f(log x)`` (``f`` takes the logarithm).

    ``grid`` log-spaced points bracket the minimum (the best point and its two neighbours),
    ``iters`` golden-section steps on ``log x`` refine it, one evaluation of ``f`` per step;
    ties keep the left part. Returns ``x`` at the centre of the final bracket.
    """
    xs = torch.linspace(math.log(lower), math.log(upper), grid).tolist()
    values = [f(x) for x in xs]
    best = min(range(grid), key=values.__getitem__)
    lo, hi = xs[max(best - 1, 0)], xs[min(best + 1, grid - 1)]
    r = (math.sqrt(5) - 1) / 2  # 1/φ: each step keeps this fraction of the bracket
    c, d = hi - r * (hi - lo), lo + r * (hi - lo)
    fc, fd = f(c), f(d)
    for _ in range(iters):
        if fc <= fd:  # the minimum lies in [lo, d]; the old c becomes the new d
            hi, d, fd = d, c, fc
            c = hi - r * (hi - lo)
            fc = f(c)
        else:  # in [c, hi]; the old d becomes the new c
            lo, c, fc = c, d, fd
            d = lo + r * (hi - lo)
            fd = f(d)
    return math.exp((lo + hi) / 2)
