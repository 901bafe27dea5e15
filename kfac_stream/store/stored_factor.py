"""The store's factor records: `StoredFactor` (one EMA factor as the store keeps it, with its
pending updates), `FactorState` (one factor as of a flush: what checkpoints, snapshots and
monitors read), the factor's fixed probes (`probes`) and the norms computed from them.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .device_fold import DevicePending
from .fold_cost import PROBES, probe_columns

#: Rows per chunk of the host fold.
CHUNK_ROWS = 128


def dequantise(data: Tensor, scale: float, dtype: torch.dtype | None) -> Tensor:
    """``scale · data`` in ``dtype`` (default float32, float64 for float64 data)."""
    out = data.to(dtype or (torch.float64 if data.dtype == torch.float64 else torch.float32))
    return out * scale if scale != 1.0 else out


@dataclass(frozen=True)
class FactorState:
    """One stored factor as of a flush: what checkpoints, snapshots and monitors read.

    Attributes:
        data: ``[d, d]`` (dense) or ``[d]`` (diagonal) in the storage dtype (a copy).
        scale: ``F = scale · data``.
        amax: Bound on the largest ``|F|`` entry (chooses the next float16 scale).
        weight: EMA weight ``w``.
        updates: Number of updates folded in.
        positions: Sampled positions over all updates.
        diagonal: Whether only the diagonal is kept.
        sq_norm_sum: ``Q = Σ_k c_k ‖S_k Z‖²_F / p`` with the EMA's unnormalised
            coefficients ``c_k = n_k Π_{j>k} λ_j`` (so ``Σ_k c_k = w``) and the factor's fixed
            Gaussian probes ``Z [d, p]`` (`probes`; a diagonal factor: ``‖S_k‖²`` exactly).
            0: not recorded.
        weight_sq: ``R = Σ_k c_k²``.
        spread: ``Σ_k (c_k/w) ‖S_k − F‖²_F`` as estimated with the same probes,
            ``Q/w − ‖F Z‖²/p`` (NaN: not recorded): the updates' spread around their mean,
            from which `sampling_error` follows. ``F Z`` is the `sketch`, kept as the updates
            arrive: no pass over the factor's entries.
        sq_frob: ``‖F‖²_F`` of the stored factor, computed by the fold that wrote it (NaN:
            not recorded: computed from ``data`` when needed).
        sketch: ``F Z`` (``[d, p]`` float64) of the EMA, updated with every update as
            ``(1-η)·FZ + η·S Z`` from the update's own sketch ``S Z`` (the EMA is linear);
            None for a diagonal factor or before the first update.
    """

    data: Tensor
    scale: float
    amax: float
    weight: float
    updates: int
    positions: int
    diagonal: bool
    sq_norm_sum: float = 0.0
    weight_sq: float = 0.0
    spread: float = math.nan
    sq_frob: float = math.nan
    sketch: Tensor | None = None

    def value(self, dtype: torch.dtype | None = None) -> Tensor:
        """Dequantised factor, ``[d, d]`` or ``[d]``, float32 (float64 if stored so)."""
        return dequantise(self.data, self.scale, dtype)

    def sampling_error(self) -> tuple[float, float]:
        """``(relative standard error, effective updates)`` of the factor as an estimate of
        the mean of its updates' expected statistics.

        ``F = Σ_k (c_k/w) S_k`` with independent update statistics ``S_k`` (each from its
        own random positions and MC labels): ``E‖F − E F‖² = Σ_k (c_k/w)² tr Var(S)`` when the
        updates share one variance, estimated by the weighted spread of the updates around
        ``F``, ``Σ_k (c_k/w)‖S_k − F‖² = Q/w − ‖F‖²`` (`spread`, measured through the same
        probes as ``Q``), whose expectation is ``(1 − R/w²) tr Var(S)``. So ``SE² = spread ·
        (R/w²) / (1 − R/w²)`` and the relative error is ``SE/‖F‖_F`` (Frobenius). Effective
        updates: ``w²/R`` (the number of equal-weight updates with the same variance). NaN
        when not recorded (no update); infinite with one effective update (no spread to
        measure). Tested against replicated runs and the exact expected Fisher in
        ``tests/unit/snapshot/test_sampling_error.py``.
        """
        w, r, spread = float(self.weight), float(self.weight_sq), float(self.spread)
        if w <= 0.0 or r <= 0.0:
            return math.nan, math.nan
        c2 = r / (w * w)  # Σ (c_k/w)² = 1 / effective updates
        if c2 >= 1.0 - 1e-9:
            return math.inf, 1.0
        f2 = self.sq_frob if math.isfinite(self.sq_frob) else sq_norm(self.data, self.scale)
        if math.isnan(spread) or f2 <= 0.0:
            return math.nan, 1.0 / c2
        var = max(spread, 0.0) / (1.0 - c2)
        return math.sqrt(var * c2 / f2), 1.0 / c2


def sq_norm(data: Tensor, scale: float, z: Tensor | None = None) -> float:
    """``‖F‖²_F`` of ``F = scale · data`` (``[d, d]`` or ``[d]``), or with probes ``z [d, p]``
    ``‖F z‖²_F / p``; in row chunks of `CHUNK_ROWS` (float64 accumulation, no ``d²`` float64
    copy: this runs when a snapshot or checkpoint exports the factors)."""
    total = 0.0
    for start in range(0, data.shape[0], CHUNK_ROWS):
        rows = data[start:start + CHUNK_ROWS].double() * scale  # [c, d] or [c]
        part = rows if z is None else rows @ z
        total += float(part.square().sum())
    return total if z is None else total / z.shape[1]


@dataclass
class StoredFactor:
    """One EMA factor on CPU.

    Attributes:
        data: ``[d, d]`` (dense) or ``[d]`` (diagonal) in the storage dtype (pinned when the
            store's device is CUDA, so flushes copy it asynchronously).
        scale: ``F = scale · data`` (1.0 unless float16).
        amax: Bound on the largest ``|F|`` entry, used to choose the next scale.
        weight: EMA weight ``w`` (includes pending updates).
        updates: Number of updates (including pending ones).
        positions: Number of positions (rows) over all updates.
        diagonal: Whether only the diagonal is kept.
        pending: ``[(rows [m, d], eta, n)]`` not yet folded into ``data`` (weighted rows:
            ``S = rowsᵀrows / n``; the host path).
        sq_norm_sum, weight_sq: See `FactorState`; ``sq_norm_sum`` is a 0-dim device tensor
            while device statistics add to it (read when the factor is flushed).
        device: The pending statistic on the device (`device_fold.DevicePending`; None: none
            allocated).
        resident: Its pending statistic stays on the device between updates (the budget's
            residency plan); a factor that is not folds every update at once.
        folded_trace: ``scale · Σ diag(data)`` as of the last completed fold: set in one
            assignment when a fold has written every entry and the scale, so a reader on
            another thread (monitoring between snapshots) never sees a half-written factor.
        live_trace: The trace with the device's pending statistic folded in, as of the last
            update applied (`FactorStore.end_update`); None: the same as ``folded_trace``.
        sq_frob: ``‖scale·data‖²_F`` as of the last completed fold (computed by the fold from
            the values it wrote; NaN until then).
        fz: ``F Z`` of the EMA (``[d, p]`` float64, on the device of the updates), see
            `FactorState.sketch`; None for a diagonal factor or before the first update.
        lent: ``data`` is held by a snapshot still being written (`FactorStore.state_dict`
            with ``lend``): the next write goes into another tensor (``spare``, or a new one)
            and ``data`` is left to the snapshot until `FactorStore.release`.
        spare: A tensor like ``data`` that no one holds (a released snapshot's), for the next
            write while ``data`` is lent; None: allocated when needed.
    """

    data: Tensor
    scale: float = 1.0
    amax: float = 0.0
    weight: float = 0.0
    updates: int = 0
    positions: int = 0
    diagonal: bool = False
    sq_norm_sum: float | Tensor = 0.0
    weight_sq: float = 0.0
    pending: list[tuple[Tensor, float, float]] = field(default_factory=list)
    device: DevicePending | None = None
    resident: bool = True
    folded_trace: float = 0.0
    live_trace: float | None = None
    sq_frob: float = math.nan
    fz: Tensor | None = None
    lent: bool = False
    spare: Tensor | None = None

    @property
    def pending_rows(self) -> int:
        """Rows waiting to be folded in."""
        return sum(r.shape[0] for r, _, _ in self.pending)

    @property
    def device_updates(self) -> int:
        """Updates waiting in the device's pending statistic."""
        return 0 if self.device is None or self.device.empty else self.device.updates

    def value(self, dtype: torch.dtype | None = None) -> Tensor:
        """Dequantised folded factor, ``[d, d]`` or ``[d]``, float32 (float64 if stored so)."""
        return dequantise(self.data, self.scale, dtype)

    def trace(self) -> float:
        """The trace with every update applied so far (the device's pending statistic
        included, as of the last `FactorStore.end_update`; host rows still pending not);
        safe to call while another thread folds."""
        live = self.live_trace
        return self.folded_trace if live is None else live

    def recompute_trace(self) -> None:
        """Set `folded_trace` from ``data`` and ``scale`` (after a fold or a load)."""
        diag = self.data if self.diagonal else self.data.diagonal()
        self.folded_trace = float(diag.double().sum()) * self.scale
        self.live_trace = None


def probes(key: str, d: int, device=None) -> Tensor:
    """The factor's fixed probes ``Z [d, p]`` (float64), the same on every rank and after a
    resume: ``p = PROBES`` Gaussian columns from a generator seeded by the key's CRC32, or the
    identity (``p = d``: exact) when ``d ≤ 4·PROBES`` (`fold_cost.probe_columns`). Fixed
    probes make the spread of one factor a sketch whose relative error is about
    ``sqrt(2 / (p · effective rank))``."""
    if probe_columns(d) == d:
        z = torch.eye(d, dtype=torch.float64) * math.sqrt(d)  # ‖S Z‖²/p = ‖S‖²
    else:
        gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
        z = torch.randn(d, PROBES, generator=gen, dtype=torch.float64)
    return z if device is None else z.to(device)


def sketch_sq_norm(stat_z: Tensor) -> Tensor:
    """``‖S Z‖²_F / p`` from ``S Z [d, p]``: an unbiased estimate of ``‖S‖²_F``."""
    return stat_z.double().square().sum() / stat_z.shape[-1]
