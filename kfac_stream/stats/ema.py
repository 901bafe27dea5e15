r"""The token-weighted, bias-free EMA (docs/computed.md).

Each factor keeps a weight :math:`w` (0 before the first update). An update with a step
statistic :math:`S_k` built from :math:`n_k` positions does

.. math::
    w \leftarrow \lambda w + n_k, \qquad F \leftarrow F + \frac{n_k}{w}(S_k - F).

The first update sets :math:`F = S_1`; :math:`\lambda = 1` gives the exact token-weighted mean
of all updates; closed form :math:`F_K = \sum_k \lambda^{K-k} n_k S_k / \sum_k \lambda^{K-k} n_k`.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor


def ema_step(weight: float, n: int, decay: float) -> tuple[float, float]:
    """Advance the EMA weight.

    Returns:
        ``(new_weight, eta)`` where ``F_new = F + eta·(S − F)``.
    """
    new_weight = decay * weight + float(n)
    return new_weight, float(n) / new_weight


def ema_closed_form(stats: Sequence[Tensor], counts: Sequence[int], decay: float) -> Tensor:
    """Reference value of the EMA after all updates (for tests and checks).

    Args:
        stats: Step statistics ``S_k``, each ``[d, d]`` or ``[d]``.
        counts: ``n_k`` per update.
        decay: ``λ``.
    """
    K = len(stats)
    coeffs = [decay ** (K - 1 - k) * counts[k] for k in range(K)]
    total = sum(coeffs)
    out = stats[0] * (coeffs[0] / total)
    for c, s in zip(coeffs[1:], stats[1:]):
        out = out + s * (c / total)
    return out
