r"""Recover the factor :math:`c` by which the trainer scaled the summed per-token loss.

Hook gradients are :math:`c\,g_s` with :math:`g_s = \partial L/\partial z_s` for the SUM
:math:`L = \sum_t \ell_t` and an unknown :math:`c > 0` (mean reduction, ``num_items_in_batch``,
gradient accumulation, AMP/DeepSpeed loss scaling all fold into it). At the logits of a
loss-bearing position the observed gradient is :math:`c\,(p_t - e_{y_t})` with
:math:`p_t = \mathrm{softmax}(\text{logits}_t)`; its one negative entry marks :math:`y_t`
(so no labels are needed), and :math:`c` is the least-squares fit

.. math::  c = \frac{\sum_t \langle \nabla_t, r_t\rangle}{\sum_t \lVert r_t\rVert^2},
           \qquad r_t = p_t - e_{\arg\min \nabla_t}

over rows with a non-zero gradient. The relative residual
:math:`\lVert \nabla - c\,r\rVert / \lVert\nabla\rVert` tells whether the loss really is a
(scaled) cross-entropy sum: it is ~0 (rounding) for HF's losses and user losses that sum or
average tokens uniformly, and large for label smoothing or per-token weights.
"""

from __future__ import annotations

import torch
from torch import Tensor


def cross_entropy_scale(logits: Tensor, grad: Tensor) -> tuple[float, float, int]:
    """Least-squares loss scale from logits and their gradient.

    Args:
        logits: ``[N, V]`` logits of N positions (any float dtype).
        grad: ``[N, V]`` gradient of the trainer's loss w.r.t. those logits.

    Returns:
        ``(c, relative_residual, rows_used)``; ``c = nan`` when no row carries gradient or the
        gradient is not finite.
    """
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    g = grad.detach().to(dtype)
    live = g.abs().amax(dim=-1) > 0  # [N]
    if not bool(live.any()):
        return float("nan"), float("nan"), 0
    g = g[live]  # [m, V]
    r = torch.softmax(logits.detach()[live].to(dtype), dim=-1)  # [m, V]
    y = g.argmin(dim=-1)  # [m]
    r[torch.arange(r.shape[0], device=r.device), y] -= 1.0
    denom = (r * r).sum()
    c = (g * r).sum() / denom
    resid = torch.linalg.vector_norm(g - c * r) / torch.linalg.vector_norm(g)
    return float(c), float(resid), int(g.shape[0])
