"""The host path's fold of a stored factor: ``F ← α·F + YᵀY`` (rows) or ``F ← α·F + S`` (a
statistic), the FP16 scale chosen from the diagonals, the dense update over the upper triangle
in row chunks and mirrored (`FactorStore` calls it on a factor it owns, made writable)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..stats.fp16 import fp16_exponent
from .fold_cost import host_fold_entries
from .stored_factor import CHUNK_ROWS, StoredFactor
from .traffic import Traffic


def fold(f: StoredFactor, alpha: float, *, y: Tensor | None = None,
         stat: Tensor | None = None, compute_dtype: torch.dtype, storage_dtype: torch.dtype,
         traffic: Traffic) -> None:
    """``F ← alpha·F + YᵀY`` (``y``: ``[m, d]``) or ``F ← alpha·F + stat`` on the host.

    Both terms and ``F`` are PSD, so ``max|F_ij| = max_i F_ii``: the FP16 scale is chosen
    from the diagonals alone. The dense update is one fused ``addmm`` per chunk of rows
    (``beta·F + gamma·YᵀY``, the rescaling folded into ``beta``/``gamma``) over the upper
    triangle only, mirrored below: half the flops of a full ``YᵀY``, and a stored factor
    that is exactly symmetric.
    """
    cd = compute_dtype
    term_diag = y.square().sum(0) if y is not None else (
        stat if f.diagonal else stat.diagonal())  # [d]
    bound = alpha * f.amax + float(term_diag.abs().max())
    fp16 = storage_dtype == torch.float16
    new_scale = 2.0 ** fp16_exponent(bound) if fp16 and bound > 0 else 1.0
    beta, gamma = f.scale * alpha / new_scale, 1.0 / new_scale
    traffic.host_entries += host_fold_entries(f.data.shape[0], f.diagonal)
    sq = torch.zeros((), dtype=torch.float64)  # Σ data² of what this fold writes
    if f.diagonal:
        new = f.data.to(cd).mul_(beta).add_(term_diag, alpha=gamma)  # [d]
        f.data.copy_(new)
        sq += f.data.to(cd).square().sum(dtype=torch.float64)
    elif y is not None:
        d = f.data.shape[0]
        for start in range(0, d, CHUNK_ROWS):
            stop = min(start + CHUNK_ROWS, d)
            # upper block row only (half the GEMM flops), then mirrored below the diagonal
            cur = f.data[start:stop, start:].to(cd)  # [c, d-start]
            cur = torch.addmm(cur, y[:, start:stop].T, y[:, start:], beta=beta, alpha=gamma)
            blk = cur[:, :stop - start]  # diagonal block: made exactly symmetric
            cur[:, :stop - start] = blk.triu() + blk.triu(1).T
            f.data[start:stop, start:].copy_(cur)  # rounds to the storage dtype
            wrote = f.data[start:stop, start:].to(cd)  # each entry above the diagonal
            sq += 2 * wrote.square().sum(dtype=torch.float64) - wrote[  # block counts
                :, :stop - start].square().sum(dtype=torch.float64)  # twice, inside once
            if stop < d:
                f.data[stop:, start:stop].copy_(f.data[start:stop, stop:].T)
    else:
        for start in range(0, f.data.shape[0], CHUNK_ROWS):
            rows = slice(start, min(start + CHUNK_ROWS, f.data.shape[0]))
            f.data[rows].copy_(f.data[rows].to(cd) * beta + stat[rows] * gamma)
            sq += f.data[rows].to(cd).square().sum(dtype=torch.float64)
    f.sq_frob = float(sq) * new_scale * new_scale
    diag = f.data if f.diagonal else f.data.diagonal()
    f.scale, f.amax = new_scale, float(diag.to(cd).abs().max()) * new_scale
    f.recompute_trace()  # one float assignment: readers see the old or the new trace
