"""The canonical row format: every captured tensor becomes ``[n, d]`` rows.

A layer input or output gradient of shape ``[B, T, d]`` (or any ``[..., d]``) is flattened to
``[B*T, d]`` (position ``s = b*T + t``), and the rows of the sampled positions are gathered.
Usable positions are those with ``attention_mask == 1``; padding rows are never gathered.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def usable_positions(attention_mask: Tensor | None, batch_shape: tuple[int, int],
                     device: torch.device) -> Tensor:
    """Boolean mask of usable positions.

    Args:
        attention_mask: ``[B, T]`` (1 = real token, 0 = padding) or None (all real).
        batch_shape: ``(B, T)``.
        device: Device of the returned mask.

    Returns:
        ``[B*T]`` bool.
    """
    if attention_mask is None:
        return torch.ones(batch_shape[0] * batch_shape[1], dtype=torch.bool, device=device)
    if attention_mask.dim() != 2:  # 4-D custom masks: fall back to "every position"
        return torch.ones(batch_shape[0] * batch_shape[1], dtype=torch.bool, device=device)
    return attention_mask.reshape(-1).to(device=device) != 0


def slots_per_pass(fraction: float, n_positions: int) -> int:
    """Fixed number of sampled slots of a pass: ``ceil(fraction · N)``, in ``[1, N]``."""
    return max(1, min(n_positions, math.ceil(fraction * n_positions)))


def sample_positions(usable: Tensor, fraction: float, generator: torch.Generator | None
                     ) -> tuple[Tensor, Tensor]:
    r"""Draw a fixed number of positions among the usable ones, on ``usable.device``, without
    reading anything on the host (no ``nonzero``, no ``.item()``).

    ``m = ceil(fraction·N)`` slots. Every position gets a uniform random key, padding gets key
    2 (never below a usable one); the ``m`` smallest keys win (``topk``): a uniformly random
    subset of ``min(m, U)`` of the ``U`` usable positions, plus ``max(0, m − U)`` padding
    slots. Each usable slot carries the Horvitz–Thompson weight
    :math:`1/\pi = \max(1, U/m)` (the inverse of its inclusion probability
    :math:`\pi = \min(1, m/U)`), each padding slot weight 0, so the weights of a pass sum to
    exactly ``U`` and :math:`\sum_s w_s x_s x_s^\top / \sum_s w_s` is an unbiased estimate of
    the pass's mean over its usable positions; over several passes it is token-weighted.

    ``fraction == 1`` takes every position (``arange``, no draw) with weight 1 on usable and 0
    on padding: the exact full-batch statistic.

    Args:
        usable: ``[N]`` bool (N = B*T).
        fraction: Slots per position, in (0, 1].
        generator: Generator on ``usable.device`` (advanced once per pass if ``fraction < 1``).

    Returns:
        ``(index [m] int64 ascending, weight [m] float32)`` on ``usable.device``.
    """
    n = usable.shape[0]
    if fraction >= 1.0:
        return torch.arange(n, device=usable.device), usable.to(torch.float32)
    m = slots_per_pass(fraction, n)
    keys = torch.rand(n, generator=generator, device=usable.device)
    keys = torch.where(usable, keys, 2.0)
    index = torch.topk(keys, m, largest=False, sorted=False).indices.sort().values  # [m]
    count = usable.sum().to(torch.float32)  # U, stays on the device
    weight = usable.index_select(0, index).to(torch.float32) * (count / m).clamp(min=1.0)
    return index, weight


def gather_rows(x: Tensor, index: Tensor, n_positions: int, dtype: torch.dtype | None
                ) -> Tensor:
    """Rows of the sampled positions.

    Args:
        x: ``[..., d]`` with ``prod(...) == n_positions`` (e.g. ``[B, T, d]``).
        index: ``[n]`` flat position indices.
        n_positions: ``B*T`` of the forward pass, to check the layout.
        dtype: Dtype of the returned rows; None keeps the input's.

    Returns:
        ``[n, d]`` detached rows.
    """
    d = x.shape[-1]
    flat = x.detach().reshape(-1, d)  # [B*T, d]
    if flat.shape[0] != n_positions:
        raise RuntimeError(
            f"a tracked layer saw {flat.shape[0]} positions but the forward pass has "
            f"{n_positions}: kfac_stream needs layer inputs shaped [batch, seq, features] (or "
            "their rows [batch*seq, features]) over the input's positions; an encoder-decoder "
            "whose decoder length differs from its input length is not supported yet: pad the "
            "labels to the input length, or exclude the decoder layers (KFACConfig(exclude="
            "[r'decoder']))"
        )
    rows = flat.index_select(0, index)
    return rows if dtype is None else rows.to(dtype)
