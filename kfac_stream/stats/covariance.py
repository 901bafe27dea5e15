r"""Second moments of captured rows: the step statistics of K-FAC (expand form).

For rows ``X`` (``[n, d]``) the step statistic is :math:`S = \frac1n X^\top X`, with
:math:`\bar a = [a; 1]` (a ones column appended last) for layers with a bias.
The diagonal variant (factors longer than ``max_dense_dim``) is
:math:`\mathrm{diag}(S) = \frac1n \sum_s x_s \odot x_s`.
"""

from __future__ import annotations

import torch
from torch import Tensor


def with_bias_column(rows: Tensor) -> Tensor:
    """``[n, d]`` → ``[n, d+1]`` with a trailing column of ones."""
    return torch.cat([rows, rows.new_ones(rows.shape[0], 1)], dim=1)


def gram(rows: Tensor, diagonal: bool = False) -> Tensor:
    """Summed outer product ``XᵀX`` of rows (its diagonal ``Σ x⊙x`` if ``diagonal``).

    Args:
        rows: ``[n, d]`` (``n = 0`` gives zeros).
        diagonal: Return only the diagonal.

    Returns:
        ``[d, d]`` (dense) or ``[d]`` (diagonal), same dtype as ``rows``.
    """
    return rows.square().sum(0) if diagonal else rows.T @ rows


def weighted_squares(rows: Tensor, weight: Tensor, dtype: torch.dtype) -> Tensor:
    """``Σ_s w_s x_s ⊙ x_s``: the diagonal statistic of weighted rows, reduced at once.

    Args:
        rows: ``[m, d]`` (any float dtype).
        weight: ``[m]`` sampling weights; rows with ``w = 0`` (padding) are left out even if
            they hold NaN/Inf.
        dtype: Dtype of the sum (float32, or float64).

    Returns:
        ``[d]`` in ``dtype``.
    """
    keep = (weight > 0)[:, None]
    return torch.where(keep, rows.to(dtype).square(), 0.0).mul_(weight[:, None].to(dtype)).sum(0)


def all_finite(tensors: list[Tensor]) -> Tensor:
    """0-dim bool tensor: every entry of every tensor is finite; one reduction per tensor and
    nothing read on the host (the caller's worker reads it). On the first tensor's device.

    A sum is NaN/Inf whenever an entry is (Inf - Inf = NaN), and only overflows on its own for
    magnitudes near 3e38 (float32), which are as unusable for the factors as an Inf.
    """
    if not tensors:
        return torch.ones((), dtype=torch.bool)
    return torch.isfinite(torch.stack([t.sum().to(torch.float64) for t in tensors])).all()
