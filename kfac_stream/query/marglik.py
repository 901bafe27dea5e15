r"""The marginal-likelihood prior precision from eigenvalues only, fast at scale.

The τ-dependent Laplace log evidence of the tracked weights (`kron_eigen.marglik_terms` summed
over the layers) is, with ``t = log τ``, ``P`` weights of squared norm ``s`` and the pair
eigenvalues ``λ_ij = N γ_i α_j`` of every layer,

    F(t) = P t / 2 − e^t s / 2 − ½ Σ log(λ_ij + e^t),
    F'(t) = ½ Σ λ_ij / (λ_ij + τ) − τ s / 2,

and ``F'`` is strictly decreasing (each ``λ/(λ+τ)`` falls with τ, ``τ s`` rises): ``F`` has one
maximum, where ``F' = 0``.

`EvidenceBins` keeps the histogram of ``log λ_ij`` over bins of width ``2w``, built
from the per-factor histograms of ``log γ`` and ``log α`` (width ``w``) by one FFT convolution
(counts are integers; rounding the FFT makes them exact), never from the ``d_out·d_A`` pairs;
the bins lie on one global grid, so the layers' histograms add into one.
Each pair is represented by its bin's centre, within ``w`` of its ``log λ``, so each term
``log(λ + τ)`` is within ``w`` (its slope in ``log λ`` is ``λ/(λ+τ) ≤ 1``) and each
``λ/(λ+τ)`` within ``w/4``: the surrogate ``F`` is within ``P·w/2`` of the exact one, with
``w = BIN_WIDTH``. The grid and golden-section search of
`calibration.minimise_over_log_range` runs on that surrogate (cost: the number of non-empty
bins per evaluation, not the number of pairs; `EvidenceBins.maximise`), and `newton_polish`
then takes Newton steps on the *exact* ``F'`` (one pass over the pairs each, ``λ`` recomputed
per layer from the eigenvalues, never stored) until the step is below `POLISH_TOL`; a step of
the surrogate's error ``δ`` leaves ``O(δ²)``, so the tuned ``τ`` is the exact maximiser to
~1e-8 relative (tests/unit/query/test_marglik.py checks it against the dense search).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ..utils.progress import progress
from .calibration import minimise_over_log_range

#: Width ``w`` (natural-log units) of the per-factor eigenvalue bins.
BIN_WIDTH = 1.0 / 256
#: Newton steps on the exact derivative stop once a step (in ``log τ``) is below this.
POLISH_TOL = 1e-4
#: At most this many exact passes.
POLISH_MAX = 6


def _factor_hist(vals: Tensor, width: float) -> tuple[Tensor, int, int]:
    """``(counts [B], index of the first bin, zeros)`` of non-negative ``vals`` over the global
    grid of bins ``[k w, (k+1) w)`` of ``log v`` (``v > 0``)."""
    pos = vals[vals > 0]
    zeros = vals.numel() - pos.numel()
    if pos.numel() == 0:
        return vals.new_zeros(0), 0, zeros
    idx = (pos.log() / width).floor().long()
    base = int(idx.min())
    return torch.bincount(idx - base).double(), base, zeros


class EvidenceBins:
    """Binned ``log λ`` of every tracked layer's eigenvalue pairs (module docstring).

    Args:
        eigvals: Per layer ``(γ [d_out], α [d_A])`` float64 eigenvalues (≥ 0), on any device.
        num_data: ``N``.
        weights: Per layer ``(P, ‖W̄‖²)``.
        width: ``w``.
    """

    def __init__(self, eigvals: Sequence[tuple[Tensor, Tensor]], num_data: float,
                 weights: Sequence[tuple[int, float]], width: float = BIN_WIDTH) -> None:
        self.eigvals = [(g, a) for g, a in eigvals]
        self.num_data = num_data
        self.params = float(sum(p for p, _ in weights))
        self.sq = float(sum(s for _, s in weights))
        parts: list[tuple[int, Tensor]] = []
        zero_pairs = 0
        for g, a in self.eigvals:
            hg, bg, zg = _factor_hist(g.detach().double().cpu() * num_data, width)
            ha, ba, za = _factor_hist(a.detach().double().cpu(), width)
            zero_pairs += zg * a.numel() + za * g.numel() - zg * za
            if hg.numel() == 0 or ha.numel() == 0:
                continue
            n = hg.numel() + ha.numel() - 1
            conv = torch.fft.irfft(torch.fft.rfft(hg, n) * torch.fft.rfft(ha, n), n)
            parts.append((bg + ba, conv.round().clamp_(min=0)))  # pairs in [kw, (k+2)w)
        # every layer's bins lie on one global grid: one histogram for all of them
        if parts:
            first = min(b for b, _ in parts)
            total = torch.zeros(max(b + c.numel() for b, c in parts) - first,
                                dtype=torch.float64)
            for b, c in parts:
                total[b - first:b - first + c.numel()] += c
            keep = (total > 0).nonzero()[:, 0]
            self.counts = total[keep]
            self.log_lam = (keep.double() + first + 1.0) * width  # centre of [kw, (k+2)w)
        else:
            self.counts = torch.zeros(0, dtype=torch.float64)
            self.log_lam = torch.zeros(0, dtype=torch.float64)
        self.zero_pairs = float(zero_pairs)

    @property
    def bins(self) -> int:
        """Non-empty bins over all layers (the cost of one surrogate evaluation)."""
        return int(self.counts.numel())

    def surrogate(self, log_tau: float) -> float:
        """``F(log τ)`` with every pair at its bin's centre (within ``P·w/2`` of the exact)."""
        tau = math.exp(log_tau)
        logdet = float((self.counts * torch.logaddexp(self.log_lam, self.log_lam.new_tensor(
            log_tau))).sum()) + self.zero_pairs * log_tau
        return 0.5 * self.params * log_tau - 0.5 * tau * self.sq - 0.5 * logdet

    def exact_slope(self, log_tau: float) -> tuple[float, float]:
        """``(F'(t), F''(t))`` exactly, one pass over every layer's pairs (float64, on the
        eigenvalues' device)."""
        tau = math.exp(log_tau)
        s1 = s2 = 0.0
        for g, a in self.eigvals:
            lam = torch.outer(g, a).mul_(self.num_data)
            den = lam + tau
            r = lam.div_(den).view(-1)  # λ/(λ+τ)
            one = float(r.sum())
            s1 += one
            s2 += one - float(torch.dot(r, r))  # Σ r(1 − r)
        first = 0.5 * s1 - 0.5 * tau * self.sq
        second = -0.5 * max(s2, 0.0) - 0.5 * tau * self.sq
        return first, second

    def newton_polish(self, log_tau: float, lower: float, upper: float) -> tuple[float, int]:
        """The exact maximiser in ``[log lower, log upper]`` from ``log_tau`` (a surrogate
        optimum): ``(log τ, exact passes)``."""
        lo, hi = math.log(lower), math.log(upper)
        t = min(max(log_tau, lo), hi)
        passes = 0
        for _ in range(POLISH_MAX):
            first, second = self.exact_slope(t)
            passes += 1
            if first == 0.0 or second >= 0.0 or not math.isfinite(first / second):
                break
            new = min(max(t - first / second, lo), hi)
            step, t = abs(new - t), new
            if step < POLISH_TOL:
                break
        return t, passes

    def maximise(self, lower: float, upper: float, grid: int, iters: int, *,
                 show_progress: bool | None = None) -> tuple[float, int]:
        """The shared ``τ`` in ``[lower, upper]`` maximising the evidence: ``grid`` log-spaced
        points and ``iters`` golden-section steps on the surrogate (`minimise_over_log_range`,
        ``grid + iters + 2`` evaluations, counted by a progress bar: `kfac_stream.utils.progress`),
        then `newton_polish` on the exact slope. Returns ``(τ, exact passes)``."""
        bar = progress(total=grid + iters + 2, desc=f"marglik prior precision "
                       f"({len(self.eigvals)} layers)", unit="eval", show=show_progress)

        def negative_evidence(log_tau: float) -> float:
            value = -self.surrogate(log_tau)
            bar.update()
            return value

        try:
            start = minimise_over_log_range(negative_evidence, lower, upper, grid, iters)
        finally:
            bar.close()
        log_tau, passes = self.newton_polish(math.log(start), lower, upper)
        return math.exp(log_tau), passes
