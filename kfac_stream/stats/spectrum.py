r"""Eigendecomposition of PSD factors and the spectrum statistics the snapshots carry.

``safe_psd_eigh`` follows the usual recipe for covariance-like matrices: cast to float64,
symmetrise (:math:`(F + F^\top)/2`), ``torch.linalg.eigh``; if LAPACK fails to converge, retry
with a tiny diagonal shift (removed from the eigenvalues again); clip the slightly negative
eigenvalues rounding produces to zero (the factors are PSD by construction).
"""

from __future__ import annotations

import torch
from torch import Tensor


def safe_psd_eigh(factor: Tensor, retries: int = 3) -> tuple[Tensor, Tensor | None]:
    """Eigenvalues (ascending, ≥ 0) and eigenvectors of a PSD factor, in float64.

    Args:
        factor: ``[d, d]`` dense, or ``[d]`` diagonal (then the eigenvectors are the identity
            and None is returned for them).
        retries: Shifted retries after a convergence failure.

    Returns:
        ``(eigvals [d], eigvecs [d, d] | None)`` with ``factor ≈ Q diag(λ) Qᵀ``.
    """
    f = factor.detach().to(device="cpu", dtype=torch.float64)
    if f.dim() == 1:
        return f.clamp(min=0.0), None
    f = (f + f.T) * 0.5
    shift = 0.0
    for attempt in range(retries + 1):
        try:
            w, q = torch.linalg.eigh(f if shift == 0.0 else f + shift * torch.eye(
                f.shape[0], dtype=f.dtype))
            return (w - shift).clamp_(min=0.0), q
        except RuntimeError:  # torch raises _LinAlgError (a RuntimeError) on no convergence
            if attempt == retries:
                raise
            scale = float(f.diagonal().abs().mean()) or 1.0
            shift = scale * 1e-10 * 100**attempt
    raise AssertionError("unreachable")


def spectrum_stats(eigvals: Tensor) -> dict[str, float]:
    """Largest eigenvalue, trace, condition number and effective rank.

    Args:
        eigvals: ``[d]``, ≥ 0.

    Returns:
        ``max``; ``trace``; ``cond`` = max / smallest eigenvalue above ``1e-12·max`` (inf if
        the factor is zero); ``eff_rank`` = exp of the entropy of the eigenvalues normalised
        to sum 1.
    """
    ev = eigvals.detach().double().clamp(min=0.0)
    top, total = float(ev.max()), float(ev.sum())
    if top <= 0.0:
        return {"max": 0.0, "trace": 0.0, "cond": float("inf"), "eff_rank": 0.0}
    significant = ev[ev > top * 1e-12]
    p = ev[ev > 0] / total
    return {"max": top, "trace": total, "cond": top / float(significant.min()),
            "eff_rank": float(torch.exp(-(p * p.log()).sum()))}


def log10_histogram(eigvals: Tensor, bins: int = 32) -> tuple[list[int], list[float]] | None:
    """Histogram ``(counts [bins], edges [bins + 1])`` of log10 of the positive eigenvalues of
    ``eigvals`` (``[d]``); None if none is positive."""
    ev = eigvals.detach().double()
    positive = ev[ev > 0].log10()
    if positive.numel() == 0:
        return None
    lo, hi = float(positive.min()), float(positive.max())
    if hi == lo:
        lo, hi = lo - 0.5, hi + 0.5
    counts = torch.histc(positive, bins=bins, min=lo, max=hi)
    edges = torch.linspace(lo, hi, bins + 1, dtype=torch.float64)
    return [int(c) for c in counts.tolist()], edges.tolist()
