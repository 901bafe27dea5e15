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

FIT_ROWS = 32  # rows used for the fit: the first loss-bearing ones (exact from one live row;
# 32 rows × V entries also show a label-smoothing residual plainly)


def cross_entropy_scale(logits: Tensor, grad: Tensor, max_rows: int = FIT_ROWS
                        ) -> tuple[Tensor, Tensor, Tensor]:
    """Least-squares loss scale from logits and their gradient, as device tensors.

    Nothing is read on the host, and the whole ``[N, V]`` gradient is never swept: candidate
    rows are ranked by whether any of the first and last 8 vocabulary columns has a non-zero
    gradient (a loss-bearing row's gradient ``c·(p − e_y)`` is non-zero almost everywhere),
    the first ``max_rows`` candidates are taken (``topk`` over ``position + N·(not
    candidate)``), and only on those rows is liveness decided exactly and the fit made. A
    misjudged candidate only changes which rows are fitted; the fit is exact from one live row.

    Args:
        logits: ``[N, V]`` logits of N positions (any float dtype).
        grad: ``[N, V]`` gradient of the trainer's loss w.r.t. those logits.
        max_rows: Most rows used in the fit.

    Returns:
        ``(c, relative_residual, rows_used)``, 0-dim tensors on ``logits.device`` (float32,
        float64 for float64 logits; int64 live rows among those fitted). ``c`` is NaN when no
        fitted row carries gradient, or the gradient is not finite.
    """
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    n, v = grad.shape
    grad = grad.detach()
    edge = min(8, v)  # the first and last 8 columns: contiguous, fast to reduce (measured)
    probe = torch.maximum(grad[:, :edge].abs().amax(dim=-1),
                          grad[:, v - edge:].abs().amax(dim=-1)) > 0  # [N] likely loss-bearing
    k = min(max_rows, n)
    keys = torch.arange(n, device=grad.device) + n * (~probe).long()
    pick = torch.topk(keys, k, largest=False, sorted=False).indices  # [k]
    g = grad.index_select(0, pick).to(dtype)  # [k, V]
    live = g.abs().amax(dim=-1) > 0  # [k] exact
    w = live.to(dtype)
    r = torch.softmax(logits.detach().index_select(0, pick).to(dtype), dim=-1)  # [k, V]
    r[torch.arange(k, device=r.device), g.argmin(dim=-1)] -= 1.0  # integer index: no sync
    r = r * w[:, None]
    g = g * w[:, None]
    c = (g * r).sum() / (r * r).sum()  # NaN when nothing is live (0/0)
    resid = torch.linalg.vector_norm(g - c * r) / torch.linalg.vector_norm(g)
    return c, resid, live.sum()
