r"""CPU storage of EMA Kronecker factors: FP16 with a float32 scale, or float32/float64.

Dtype contract (one table for the whole package):

==================  ======================================================================
stage               dtype
==================  ======================================================================
captured rows       float32 (float64 when ``storage_dtype="float64"``)
step statistic S    same as the rows, computed on the rows' device
EMA arithmetic      float32 (float64 for float64 storage), in chunks of ``CHUNK_ROWS`` rows
stored factor       float16 ``q`` with ``F = scale · q`` (scale a power of two, float32), or
                    float32 / float64 as is
==================  ======================================================================

FP16 scaling: before each write the new scale is chosen from a bound on ``max|F_new|``
(``(1-η)·max|F_old| + η·max|S|``) so that the largest stored magnitude is at most
``2**14`` (fp16 overflows at 65504): activations with outliers of 1e4 give second moments of
1e8, which fit after scaling. Relative rounding per entry is that of fp16 (``2**-11``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..stats.ema import ema_step

CHUNK_ROWS = 512
_FP16_TARGET = 2.0**14

_DTYPES = {"float16": torch.float16, "float32": torch.float32, "float64": torch.float64}


@dataclass
class StoredFactor:
    """One EMA factor on CPU.

    Attributes:
        data: ``[d, d]`` (dense) or ``[d]`` (diagonal) in the storage dtype.
        scale: ``F = scale · data`` (1.0 unless float16).
        amax: Largest ``|F|`` entry (exact for the stored values), used to bound the next scale.
        weight: EMA weight ``w``.
        updates: Number of updates applied.
        positions: Number of positions (rows) folded in over all updates.
    """

    data: Tensor
    scale: float = 1.0
    amax: float = 0.0
    weight: float = 0.0
    updates: int = 0
    positions: int = 0
    diagonal: bool = field(default=False)

    def value(self, dtype: torch.dtype | None = None) -> Tensor:
        """Dequantised factor, ``[d, d]`` or ``[d]``, float32 (float64 if stored so)."""
        out_dtype = dtype or (torch.float64 if self.data.dtype == torch.float64 else torch.float32)
        return self.data.to(out_dtype) * self.scale if self.scale != 1.0 else self.data.to(out_dtype)


class FactorStore:
    """The factors this rank owns, keyed ``"<layer>.A"`` / ``"<layer>.G"``."""

    def __init__(self, storage_dtype: str, ema_decay: float) -> None:
        self.storage_dtype = _DTYPES[storage_dtype]
        self.compute_dtype = torch.float64 if storage_dtype == "float64" else torch.float32
        self.ema_decay = float(ema_decay)
        self.factors: dict[str, StoredFactor] = {}

    def add(self, key: str, dim: int, diagonal: bool) -> None:
        """Allocate a zero factor ``[dim, dim]`` (or ``[dim]`` if diagonal)."""
        shape = (dim,) if diagonal else (dim, dim)
        self.factors[key] = StoredFactor(torch.zeros(shape, dtype=self.storage_dtype),
                                         diagonal=diagonal)

    def update(self, key: str, stat: Tensor, n: int) -> None:
        """Fold one step statistic into the EMA.

        Args:
            key: Factor key.
            stat: ``S``, ``[d, d]`` or ``[d]`` (any device; moved to CPU here).
            n: Number of positions ``S`` was built from (``n ≥ 1``).
        """
        f = self.factors[key]
        stat = stat.to(device="cpu", dtype=self.compute_dtype)
        new_weight, eta = ema_step(f.weight, n, self.ema_decay)
        if self.storage_dtype == torch.float16:
            self._update_fp16(f, stat, eta)
        else:
            f.data.mul_(1.0 - eta).add_(stat, alpha=eta)
            f.amax = float(f.data.abs().max())
        f.weight = new_weight
        f.updates += 1
        f.positions += int(n)

    def _update_fp16(self, f: StoredFactor, stat: Tensor, eta: float) -> None:
        bound = (1.0 - eta) * f.amax + eta * float(stat.abs().max())
        new_scale = 2.0 ** math.ceil(math.log2(bound / _FP16_TARGET)) if bound > 0 else 1.0
        data2d = f.data.view(f.data.shape[0], -1)  # [d, d] or [d, 1]
        stat2d = stat.view(stat.shape[0], -1)
        amax = 0.0
        for start in range(0, data2d.shape[0], CHUNK_ROWS):
            rows = slice(start, start + CHUNK_ROWS)
            chunk = data2d[rows].to(self.compute_dtype).mul_(f.scale * (1.0 - eta))
            chunk.add_(stat2d[rows], alpha=eta)  # F_new = (1-η)F + ηS
            amax = max(amax, float(chunk.abs().max()))
            data2d[rows] = chunk.div_(new_scale).to(torch.float16)
        f.scale, f.amax = new_scale, amax

    def values(self) -> dict[str, Tensor]:
        """All dequantised factors (float32, or float64 for float64 storage)."""
        return {k: f.value() for k, f in self.factors.items()}
