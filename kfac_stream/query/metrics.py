r"""Evaluation metrics for predictive uncertainty: pure functions on tensors, float64 inside.

Conventions shared by every function here:

* ``probs [n, C]``: one probability vector per example (entries in ``[0, 1]`` and rows summing
  to 1, both up to rounding: entries may leave ``[0, 1]`` by at most ``1e-6`` and row sums may
  differ from 1 by at most ``1e-3``); ``y [n]``: integer labels in ``[0, C)``.
* logarithms are natural (nats).
* every result is a Python ``float`` (or float64 tensors for curves).
* "uncertainty" is *higher = less certain*; selective prediction keeps the most certain
  examples (lowest uncertainty) first.
* ties in uncertainty are broken in expectation: wherever a cut falls inside a group of equal
  uncertainty, the kept part counts as a uniformly random subset of that group, i.e. it
  contributes ``(kept from the group) × (the group's mean error)``. This is exact for the
  expected value over all tie orders, deterministic, and invariant to permutations of the
  examples (a stable sort would instead depend on the input order).
* a wrong argument raises `QueryInputError` (a ValueError) with one line naming the function,
  the argument and what is allowed.

Functions: `nll`, `nll_per_example`, `ece`, `brier`, `confidence_gap` (over- or
underconfident: whether a Laplace predictive can lower the NLL), `auroc`, `risk_coverage`,
`accuracy_at_coverage`, `aurc`, `ause`, and `classification_report` (all of them at once).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..exceptions import QueryInputError

PROB_FLOOR = 1e-300
"""Probabilities are clamped to at least this before the log in `nll` (so a zero probability
of the true class costs ``-log(1e-300) ≈ 690.8`` nats instead of infinity)."""

_PROB_TOL = 1e-6  # how far an entry may leave [0, 1] by rounding
_ROWSUM_TOL = 1e-3  # how far a row sum may differ from 1


# -- validation -----------------------------------------------------------------------------------

def _fail(fn: str, msg: str) -> QueryInputError:
    return QueryInputError(f"metrics.{fn}: {msg}")


def _check_probs(fn: str, probs: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """``(probs [n, C] float64, y [n] int64)`` after checking shapes, ranges and labels."""
    if not isinstance(probs, Tensor) or probs.dim() != 2 or probs.shape[0] < 1 \
            or probs.shape[1] < 1:
        shape = tuple(probs.shape) if isinstance(probs, Tensor) else type(probs).__name__
        raise _fail(fn, f"probs must be a tensor [n, C] with n, C >= 1, got {shape}")
    if not probs.is_floating_point():
        raise _fail(fn, f"probs must be floating point, got {probs.dtype}")
    p = probs.detach().to(torch.float64)
    if not bool(torch.isfinite(p).all()):
        raise _fail(fn, "probs must be finite, got NaN or inf")
    lo, hi = float(p.min()), float(p.max())
    if lo < -_PROB_TOL or hi > 1 + _PROB_TOL:
        raise _fail(fn, f"probs must lie in [0, 1], got values in [{lo:.6g}, {hi:.6g}]")
    dev = float((p.sum(1) - 1).abs().max())
    if dev > _ROWSUM_TOL:
        raise _fail(fn, f"probs rows must sum to 1 (within {_ROWSUM_TOL:g}), got a row off by "
                        f"{dev:.3g}")
    n, C = p.shape
    if not isinstance(y, Tensor) or y.dim() != 1 or y.shape[0] != n:
        shape = tuple(y.shape) if isinstance(y, Tensor) else type(y).__name__
        raise _fail(fn, f"y must be a tensor [n] with n = {n} (the rows of probs), got {shape}")
    if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
        raise _fail(fn, f"y must hold integer labels, got {y.dtype}")
    y = y.detach().to(torch.int64).cpu()
    if int(y.min()) < 0 or int(y.max()) >= C:
        raise _fail(fn, f"y must lie in [0, {C}) (the columns of probs), got values in "
                        f"[{int(y.min())}, {int(y.max())}]")
    return p.clamp(0.0, 1.0).cpu(), y


def _check_vector(fn: str, name: str, x: Tensor, n: int | None = None) -> Tensor:
    """``x`` as a float64 ``[n]`` tensor, non-empty, NaN-free (infinities allowed)."""
    if not isinstance(x, Tensor) or x.dim() != 1 or x.shape[0] < 1:
        shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise _fail(fn, f"{name} must be a non-empty 1-D tensor, got {shape}")
    if n is not None and x.shape[0] != n:
        raise _fail(fn, f"{name} must have the same length as the first argument ({n}), "
                        f"got {x.shape[0]}")
    if x.is_complex():
        raise _fail(fn, f"{name} must be real, got {x.dtype}")
    v = x.detach().to(torch.float64).cpu()
    if bool(torch.isnan(v).any()):
        raise _fail(fn, f"{name} must not contain NaN")
    return v


def _check_finite_vector(fn: str, name: str, x: Tensor, n: int | None = None) -> Tensor:
    v = _check_vector(fn, name, x, n)
    if not bool(torch.isfinite(v).all()):
        raise _fail(fn, f"{name} must be finite, got inf")
    return v


def _check_correct(fn: str, correct: Tensor) -> Tensor:
    """``correct`` (bool, or numbers in {0, 1}) as a float64 ``[n]`` tensor of 0/1."""
    v = _check_vector(fn, "correct", correct)
    if not bool(((v == 0) | (v == 1)).all()):
        raise _fail(fn, "correct must be boolean (or 0/1), got other values")
    return v


def _check_bins(fn: str, bins: int) -> int:
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise _fail(fn, f"bins must be an integer >= 1, got {bins!r}")
    return bins


# -- tie-averaged prefix means ---------------------------------------------------------------------

def _tie_averaged_prefix_sums(values: Tensor, key: Tensor) -> Tensor:
    """``S [n]``: ``S[k-1]`` = sum of ``values`` over the ``k`` examples of smallest ``key``,
    expected over uniformly random orders within ties of ``key`` (float64)."""
    skey, order = torch.sort(key, stable=True)
    v = values[order]
    _, counts = torch.unique_consecutive(skey, return_counts=True)
    ends = counts.cumsum(0)  # exclusive end of each group in sorted order
    starts = ends - counts
    cum = torch.cat([v.new_zeros(1), v.cumsum(0)])
    group_sum = cum[ends] - cum[starts]
    group = torch.repeat_interleave(torch.arange(len(counts)), counts)  # group of position k-1
    k = torch.arange(1, len(v) + 1, dtype=torch.float64)
    return cum[starts][group] + (k - starts[group]) * (group_sum / counts)[group]


def _prefix_means(values: Tensor, key: Tensor) -> Tensor:
    """``M [n]``: ``M[k-1]`` = tie-averaged mean of ``values`` over the ``k`` smallest keys."""
    k = torch.arange(1, len(values) + 1, dtype=torch.float64)
    return _tie_averaged_prefix_sums(values, key) / k


# -- calibration ----------------------------------------------------------------------------------

def nll_per_example(probs: Tensor, y: Tensor) -> Tensor:
    """Negative log-likelihood of each label, in nats.

    Args:
        probs: ``[n, C]`` predictive probabilities.
        y: ``[n]`` integer labels in ``[0, C)``.

    Returns:
        ``[n]`` float64: ``−log max(probs[i, y_i], PROB_FLOOR)``.
    """
    p, y = _check_probs("nll_per_example", probs, y)
    return -p.gather(1, y[:, None])[:, 0].clamp(min=PROB_FLOOR).log()


def nll(probs: Tensor, y: Tensor) -> float:
    r"""Mean negative log-likelihood (nats).

    .. math:: \mathrm{NLL} = -\frac1n \sum_{i=1}^n \log \max(p_{i, y_i}, 10^{-300})

    Args:
        probs: ``[n, C]`` predictive probabilities (not log-probabilities; pass
            ``log_probs.exp()``: the floor `PROB_FLOOR` then bounds each term by 690.8 nats).
        y: ``[n]`` integer labels in ``[0, C)``.
    """
    p, y = _check_probs("nll", probs, y)
    return float(-p.gather(1, y[:, None]).clamp(min=PROB_FLOOR).log().mean())


def ece(probs: Tensor, y: Tensor, bins: int = 15) -> float:
    r"""Expected calibration error of the top-1 prediction over equal-width confidence bins.

    With confidence :math:`c_i = \max_c p_{ic}`, prediction :math:`\hat y_i = \arg\max_c p_{ic}`
    (the first maximal class on ties, as `torch.max`), and ``B = bins`` bins
    :math:`I_1 = [0, 1/B]`, :math:`I_b = ((b-1)/B, b/B]` for :math:`b \ge 2` (right-closed; the
    first bin also holds 0),

    .. math:: \mathrm{ECE} = \sum_{b:\, n_b > 0} \frac{n_b}{n}
              \Bigl|\frac{1}{n_b}\sum_{i \in b} 1[\hat y_i = y_i]
              - \frac{1}{n_b}\sum_{i \in b} c_i\Bigr|

    Empty bins contribute 0. Bin edges are ``torch.linspace(0, 1, B + 1)`` in float64.

    Args:
        probs: ``[n, C]`` predictive probabilities.
        y: ``[n]`` integer labels in ``[0, C)``.
        bins: number of bins ``B >= 1``.
    """
    p, y = _check_probs("ece", probs, y)
    B = _check_bins("ece", bins)
    conf, pred = p.max(1)
    acc = (pred == y).to(torch.float64)
    edges = torch.linspace(0, 1, B + 1, dtype=torch.float64)
    # bucketize (right=False): index b with edges[b] < conf <= edges[b+1]; conf <= edges[1] -> 0
    idx = torch.bucketize(conf, edges[1:-1], right=False)
    gap = torch.bincount(idx, weights=acc - conf, minlength=B)  # n_b · (acc_b − conf_b) [B]
    return float(gap.abs().sum() / len(conf))


def brier(probs: Tensor, y: Tensor) -> float:
    r"""Multiclass Brier score (Brier 1950): mean over examples of the squared distance between
    the probability vector and the one-hot label,

    .. math:: \mathrm{BS} = \frac1n \sum_{i=1}^n \sum_{c=1}^C (p_{ic} - 1[y_i = c])^2
              \in [0, 2].

    Not divided by ``C``; for ``C = 2`` it is twice the binary Brier score
    ``mean((p_{i1} − 1[y_i = 1])²)``.

    Args:
        probs: ``[n, C]`` predictive probabilities.
        y: ``[n]`` integer labels in ``[0, C)``.
    """
    p, y = _check_probs("brier", probs, y)
    onehot = torch.nn.functional.one_hot(y, p.shape[1]).to(torch.float64)
    return float(((p - onehot) ** 2).sum(1).mean())


# -- out-of-distribution detection ----------------------------------------------------------------

def auroc(score_in: Tensor, score_out: Tensor) -> float:
    r"""AUROC of detecting out-of-distribution examples by a score that is higher for them.

    Out-of-distribution is the positive class:

    .. math:: \mathrm{AUROC} = P(s_\text{out} > s_\text{in}) + \tfrac12 P(s_\text{out}
              = s_\text{in}) = \frac{1}{nm} \sum_{i, j} \bigl(1[o_j > a_i]
              + \tfrac12 1[o_j = a_i]\bigr)

    over all ``n × m`` pairs; 0.5 = chance, 1 = every OOD score above every ID score. Computed
    from mid-ranks (Mann–Whitney U) in ``O((n+m) log(n+m))``. Infinite scores are allowed,
    NaN is not. ``auroc(a, b) + auroc(b, a) = 1`` holds exactly in the pair count.

    Args:
        score_in: ``[n]`` scores of in-distribution examples.
        score_out: ``[m]`` scores of out-of-distribution examples.
    """
    a = _check_vector("auroc", "score_in", score_in)
    o = _check_vector("auroc", "score_out", score_out)
    n, m = len(a), len(o)
    s = torch.cat([a, o])
    _, inverse, counts = torch.unique(s, sorted=True, return_inverse=True, return_counts=True)
    below = counts.cumsum(0) - counts  # how many scores are smaller than each unique value
    midrank = below.to(torch.float64) + (counts.to(torch.float64) + 1) / 2  # 1-based
    u = float(midrank[inverse[n:]].sum()) - m * (m + 1) / 2
    return u / (n * m)


def confidence_gap(probs: Tensor, y: Tensor) -> float:
    """Mean top-1 confidence minus accuracy: ``mean_i max_c probs[i, c] − mean_i 1[argmax = y]``.

    Args:
        probs: ``[n, C]`` predictive probabilities (usually the MAP's ``softmax(logits)``).
        y: ``[n]`` integer labels in ``[0, C)``.

    Returns:
        A float in ``[−1, 1]``: ``> 0`` the predictions are **overconfident** on this set,
        ``< 0`` underconfident.

    What it says about a Laplace predictive, measured on the MAP's probabilities of a held-out
    set (the docs' "Which link" section; `benchmarks/suite.py`): every Laplace
    predictive adds logit variance and so flattens the probabilities. Where MAP is
    **overconfident** (gap > 0) that flattening is what lowers the NLL, and the default
    posterior (marginal-likelihood ``τ``) is expected to reach an NLL at or below MAP's. Where
    MAP is already **underconfident** (gap < 0) any added variance raises the NLL; only a
    ``τ`` fitted on held-out data (``HeldoutConfig(prior_precision=True)`` or
    `fit_prior_precision`), which can grow until the predictive is MAP's, keeps it at MAP's
    level, and the logit variances remain useful for ranking (OOD, selective prediction).
    """
    p, yy = _check_probs("confidence_gap", probs, y)
    return float(p.max(1).values.mean() - (p.argmax(1) == yy).double().mean())


# -- selective prediction -------------------------------------------------------------------------

def risk_coverage(correct: Tensor, uncertainty: Tensor) -> tuple[Tensor, Tensor]:
    r"""Risk–coverage curve of selective prediction: keep the ``k`` most certain examples.

    Sort by ``uncertainty`` ascending; for ``k = 1..n``

    .. math:: \mathrm{coverage}_k = k/n, \qquad
              \mathrm{risk}_k = \frac1k \sum_{i \in \text{the } k \text{ most certain}}
              (1 - \mathrm{correct}_i)

    with ties in ``uncertainty`` averaged (module docstring): a cut inside a tie group counts the
    group's error rate for the part kept.

    Args:
        correct: ``[n]`` bool (or 0/1): the prediction of example ``i`` is right.
        uncertainty: ``[n]`` higher = less certain (e.g. ``1 − max prob``, entropy, variance).

    Returns:
        ``(coverage [n], risk [n])`` float64, coverage increasing from ``1/n`` to 1.
    """
    c = _check_correct("risk_coverage", correct)
    u = _check_vector("risk_coverage", "uncertainty", uncertainty, len(c))
    n = len(c)
    coverage = torch.arange(1, n + 1, dtype=torch.float64) / n
    return coverage, _prefix_means(1 - c, u)


def accuracy_at_coverage(correct: Tensor, uncertainty: Tensor, coverage: float = 0.8) -> float:
    r"""Accuracy on the ``k`` most certain examples, ``k`` the smallest count covering
    ``coverage``: ``k = ⌈coverage · n⌉`` (computed as ``⌈coverage·n·(1 − 1e-12)⌉`` so that
    e.g. ``0.07 · 100 = 7.000000000000001`` gives 7), at least 1; the value is
    ``1 − risk_k`` of `risk_coverage` (ties averaged).

    Args:
        correct: ``[n]`` bool (or 0/1).
        uncertainty: ``[n]`` higher = less certain.
        coverage: fraction of examples kept, in ``(0, 1]``.
    """
    if isinstance(coverage, bool) or not isinstance(coverage, (int, float)) \
            or not 0 < coverage <= 1:
        raise _fail("accuracy_at_coverage", f"coverage must be a number in (0, 1], got "
                                            f"{coverage!r}")
    c = _check_correct("accuracy_at_coverage", correct)
    u = _check_vector("accuracy_at_coverage", "uncertainty", uncertainty, len(c))
    n = len(c)
    k = min(n, max(1, math.ceil(coverage * n * (1 - 1e-12))))
    return float(1 - _prefix_means(1 - c, u)[k - 1])


def aurc(correct: Tensor, uncertainty: Tensor) -> float:
    r"""Area under the risk–coverage curve (Geifman et al. 2019), the discrete form

    .. math:: \mathrm{AURC} = \frac1n \sum_{k=1}^{n} \mathrm{risk}_k

    with :math:`\mathrm{risk}_k` of `risk_coverage` (ties in ``uncertainty`` averaged): the
    right Riemann sum over coverages ``k/n``. Lower is better; a perfect ranking (all errors
    last) gives the oracle value, ``AURC − oracle = ause(1 − correct, uncertainty)``.

    Args:
        correct: ``[n]`` bool (or 0/1).
        uncertainty: ``[n]`` higher = less certain.
    """
    c = _check_correct("aurc", correct)
    u = _check_vector("aurc", "uncertainty", uncertainty, len(c))
    return float(_prefix_means(1 - c, u).mean())


def ause(error: Tensor, uncertainty: Tensor, steps: int | None = None,
         normalize: bool = False) -> float:
    r"""Area Under the Sparsification Error (Ilg et al., ECCV 2018).

    The sparsification curve removes the fraction ``f`` of examples with the *highest*
    ``uncertainty`` and reports the mean ``error`` of the rest; the oracle curve removes by
    ``error`` itself (the largest errors first), which is the lowest any ranking can reach.
    With :math:`M_u(k)` / :math:`M_o(k)` the mean error of the ``k`` examples of lowest
    uncertainty / lowest error (ties in ``uncertainty`` averaged, see the module docstring; ties
    in ``error`` do not change :math:`M_o`):

    * ``steps=None`` (default, exact per example): fractions ``f = j/n``, ``j = 0..n−1``, so
      ``k = n − j`` kept, and
      :math:`\mathrm{AUSE} = \frac1n \sum_{k=1}^{n} \bigl(M_u(k) - M_o(k)\bigr)`;
    * ``steps=S``: fractions ``f_i = i/S``, ``i = 0..S−1`` (the grid of Ilg et al.'s plots with
      ``S = 100``), removing ``⌊i·n/S⌋`` examples, and
      :math:`\mathrm{AUSE} = \frac1S \sum_{i=0}^{S-1} \bigl(M_u(n - ⌊in/S⌋)
      - M_o(n - ⌊in/S⌋)\bigr)`.

    Both are left Riemann sums of the area between the two curves over ``f ∈ [0, 1)``. AUSE
    ≥ 0, and 0 when ``uncertainty`` orders the examples like ``error``. ``normalize=True``
    divides both curves by the mean error of all examples (so each starts at 1; AUSE 0 when
    that mean is 0); the default keeps ``error``'s units.

    Args:
        error: ``[n]`` per-example error, finite (e.g. per-example NLL, or 0-1 error).
        uncertainty: ``[n]`` higher = less certain.
        steps: ``None`` for the exact per-example form, or a grid size ``S >= 1``.
        normalize: divide by the mean error.
    """
    e = _check_finite_vector("ause", "error", error)
    u = _check_vector("ause", "uncertainty", uncertainty, len(e))
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int)
                              or steps < 1):
        raise _fail("ause", f"steps must be None or an integer >= 1, got {steps!r}")
    n = len(e)
    gap = _prefix_means(e, u) - _prefix_means(e, e)  # [n], index k-1
    if steps is not None:
        kept = n - torch.arange(steps, dtype=torch.int64) * n // steps  # n - floor(i n / S)
        gap = gap[kept - 1]
    area = float(gap.mean())
    if normalize:
        scale = float(e.mean())
        return 0.0 if scale == 0 else area / scale
    return area


# -- everything at once ---------------------------------------------------------------------------

def classification_report(probs: Tensor, y: Tensor, uncertainty: Tensor | None = None,
                          bins: int = 15, coverage: float = 0.8) -> dict[str, float | int]:
    """All the metrics of one classifier's predictions, in one dict.

    Args:
        probs: ``[n, C]`` predictive probabilities.
        y: ``[n]`` integer labels in ``[0, C)``.
        uncertainty: ``[n]`` higher = less certain; default ``1 − max_c probs[i, c]``.
        bins: ECE bins.
        coverage: for ``accuracy_at_coverage``.

    Returns:
        ``{"n": n, "accuracy": mean 1[argmax = y], "nll": nll, "ece": ece(bins), "bins": bins,
        "brier": brier, "aurc": aurc, "coverage": coverage, "accuracy_at_coverage": ...,
        "ause_01": ause(0-1 error), "ause_nll": ause(per-example NLL), "confidence_gap":
        confidence_gap}``, the AUSEs exact per example and unnormalised; selective metrics use
        ``uncertainty``.
    """
    p, yy = _check_probs("classification_report", probs, y)
    correct = p.argmax(1) == yy
    if uncertainty is None:
        uncertainty = 1 - p.max(1).values
    u = _check_vector("classification_report", "uncertainty", uncertainty, len(yy))
    return {
        "n": len(yy),
        "accuracy": float(correct.double().mean()),
        "nll": nll(p, yy),
        "ece": ece(p, yy, bins),
        "bins": bins,
        "brier": brier(p, yy),
        "aurc": aurc(correct, u),
        "coverage": coverage,
        "accuracy_at_coverage": accuracy_at_coverage(correct, u, coverage),
        "ause_01": ause((~correct).double(), u),
        "ause_nll": ause(nll_per_example(p, yy), u),
        "confidence_gap": confidence_gap(p, yy),
    }
