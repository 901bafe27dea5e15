"""The canonical row format: every captured tensor becomes ``[n, d]`` rows.

A layer input or output gradient of shape ``[B, T, d]`` (or any ``[..., d]``) is flattened to
``[B*T, d]`` (position ``s = b*T + t``), and the rows of the sampled positions are gathered.
Usable positions are those with ``attention_mask == 1``; padding rows are never gathered.
"""

from __future__ import annotations

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


def sample_positions(usable: Tensor, fraction: float, generator: torch.Generator) -> Tensor:
    """Keep each usable position independently with probability ``fraction``.

    Args:
        usable: ``[N]`` bool (N = B*T).
        fraction: Keep probability in (0, 1]; ``1`` keeps every usable position and draws
            nothing from ``generator``.
        generator: CPU generator (seeded once per tracker, advanced once per forward pass).

    Returns:
        ``[n]`` int64 flat indices into ``[0, N)``, ascending, on ``usable.device``.
    """
    if fraction < 1.0:
        keep = torch.rand(usable.shape[0], generator=generator) < fraction
        usable = usable & keep.to(usable.device)
    return usable.nonzero().squeeze(1)


def gather_rows(x: Tensor, index: Tensor, n_positions: int, dtype: torch.dtype) -> Tensor:
    """Rows of the sampled positions.

    Args:
        x: ``[..., d]`` with ``prod(...) == n_positions`` (e.g. ``[B, T, d]``).
        index: ``[n]`` flat position indices.
        n_positions: ``B*T`` of the forward pass, to check the layout.
        dtype: Dtype of the returned rows (float32, or float64 for float64 storage).

    Returns:
        ``[n, d]`` detached rows.
    """
    d = x.shape[-1]
    flat = x.detach().reshape(-1, d)  # [B*T, d]
    if flat.shape[0] != n_positions:
        raise RuntimeError(
            f"a tracked layer saw {flat.shape[0]} positions but the forward pass has "
            f"{n_positions}: kfac_stream needs layer inputs shaped [batch, seq, features]"
        )
    return flat.index_select(0, index).to(dtype)
