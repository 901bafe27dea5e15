r"""CPU storage of EMA Kronecker factors: FP16 with a float32 scale, or float32/float64.

Dtype contract (one table for the whole package):

==================  ======================================================================
stage               dtype
==================  ======================================================================
captured rows       float32 (float64 when ``storage_dtype="float64"``)
step statistic S    same as the rows, computed on the rows' device
EMA arithmetic      float32 for float16 storage (its rounding dominates); float64 for float32
                    and float64 storage, so a float32 factor is the exact EMA rounded once,
                    whatever the order of its rows (ranks, micro-batches); in chunks of
                    ``CHUNK_ROWS`` rows
stored factor       float16 ``q`` with ``F = scale · q`` (scale a power of two, float32), or
                    float32 / float64 as is
==================  ======================================================================

Two ways in, by where the statistics are folded (`kfac_stream.settings.Settings.fold_on`):

* **host** (`push_rows`, CPU training): the weighted rows of an update, folded here on the
  CPU with the deferred fold below;
* **device** (`push_device`, the rows' accelerator): each update is accumulated into a
  pending statistic *resident on the device* (`device_fold`: fp32, device kernels only,
  nothing read on the host), for as many updates as come until a reader (snapshot,
  checkpoint, export) flushes, or at once for a factor the device budget leaves off the
  device. A flush streams the stored FP16 factors through the device in chunks
  (`device_fold.stream_fold`): no per-entry arithmetic on the host, one host read per flush.
  Residency is planned once per factor, largest first, within ``device_budget``.

Deferred folding of rows: rows pushed for an update are kept (``[n, d]`` each, a few percent of the
tokens) and folded into the stored factor together, every ``flush_every`` updates or when the
pending rows reach ``d`` (so they never take more memory than the factor itself). The EMA is
linear, so ``K`` pending updates fold exactly as ``F ← α·F + YᵀY`` with
``α = Π_k (1-η_k)`` and ``Y`` the stacked rows scaled by ``sqrt(η_k Π_{i>k}(1-η_i) / n_k)``:
one GEMM and one pass over the stored ``d²`` entries (one FP16 rounding) per flush instead of
per update. Readers (`values`, snapshots) flush first, so what they see is always exact.

FP16 scaling: before each write the new scale is chosen from a bound on ``max|F_new|``
(``α·max|F_old| + max|new term|``; both are PSD, so each maximum is that of the diagonal,
cheap to read) so that the largest stored magnitude is at most
``2**14`` (fp16 overflows at 65504): activations with outliers of 1e4 give second moments of
1e8, which fit after scaling. Relative rounding per entry is that of fp16 (``2**-11``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..enums import StorageDtype
from ..settings import cuda_budget
from ..stats.ema import ema_step
from ..stats.fp16 import fp16_exponent
from .device_fold import DevicePending, FlushLanes, FoldResult, accumulate, make_lanes, stream_fold
from .fold_cost import CHUNK_ENTRIES, PROBES, host_fold_entries, probe_columns
from .traffic import Traffic

logger = logging.getLogger("kfac_stream")

#: Rows per chunk of the host fold.
CHUNK_ROWS = 128


def _dequantise(data: Tensor, scale: float, dtype: torch.dtype | None) -> Tensor:
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
            not recorded, a state from an older version: computed from ``data`` when needed).
        sketch: ``F Z`` (``[d, p]`` float64) of the EMA, updated with every update as
            ``(1-η)·FZ + η·S Z`` from the update's own sketch ``S Z`` (the EMA is linear);
            None for a diagonal factor or a state from an older version.
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
        return _dequantise(self.data, self.scale, dtype)

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
        when not recorded (no update, or a state from before these sums were kept); infinite
        with one effective update (no spread to measure). Tested against replicated runs and
        the exact expected Fisher in ``tests/test_sampling_error.py``.
        """
        w, r, spread = float(self.weight), float(self.weight_sq), float(self.spread)
        if w <= 0.0 or r <= 0.0:
            return math.nan, math.nan
        c2 = r / (w * w)  # Σ (c_k/w)² = 1 / effective updates
        if c2 >= 1.0 - 1e-9:
            return math.inf, 1.0
        f2 = self.sq_frob if math.isfinite(self.sq_frob) else _sq_norm(self.data, self.scale)
        if math.isnan(spread) or f2 <= 0.0:
            return math.nan, 1.0 / c2
        var = max(spread, 0.0) / (1.0 - c2)
        return math.sqrt(var * c2 / f2), 1.0 / c2


def _sq_norm(data: Tensor, scale: float, z: Tensor | None = None) -> float:
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
        return _dequantise(self.data, self.scale, dtype)

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


def _sketch(stat_z: Tensor) -> Tensor:
    """``‖S Z‖²_F / p`` from ``S Z [d, p]``: an unbiased estimate of ``‖S‖²_F``."""
    return stat_z.double().square().sum() / stat_z.shape[-1]


class FactorStore:
    """The factors this rank owns, keyed ``"<layer>.A"`` / ``"<layer>.G"``.

    Args:
        storage_dtype: ``"float16"``, ``"float32"`` or ``"float64"``.
        ema_decay: ``λ``.
        flush_every: Host path: fold pending rows after this many updates (default 8).
        device: The device of the device path (`push_device`; None: host path only). On CUDA
            the stored factors are pinned.
        device_budget: Bytes of device memory the resident pending statistics (and the
            accumulation's work space) may take; None: decided from the CUDA device's memory
            at the first `push_device` (`kfac_stream.settings.cuda_budget`).
        traffic: Where the store counts its work (`Traffic`; the tracker passes its
            `Counters`).
    """

    def __init__(self, storage_dtype: str, ema_decay: float, flush_every: int = 8,
                 device: torch.device | None = None, device_budget: int | None = 0,
                 traffic: Traffic | None = None) -> None:
        dtype = StorageDtype(storage_dtype)
        self.storage_dtype = dtype.torch_dtype
        self.compute_dtype = dtype.compute_dtype
        self.ema_decay = float(ema_decay)
        self.flush_every = int(flush_every)
        self.device = None if device is None else torch.device(device)
        self.device_budget = device_budget
        self.traffic = traffic if traffic is not None else Traffic()
        self._factors: dict[str, StoredFactor] = {}
        self._probe_cache: dict[str, Tensor] = {}  # device probes of push_device
        self._planned = False  # residency planned (`_plan_residency`)
        self._queued: list[tuple[StoredFactor, FoldResult]] = []  # folds issued, not read
        self._lanes: FlushLanes | None = None

    @property
    def _pinned(self) -> bool:
        return self.device is not None and self.device.type == "cuda"

    def _alloc(self, shape: tuple[int, ...]) -> Tensor:
        return torch.zeros(shape, dtype=self.storage_dtype, pin_memory=self._pinned)

    def _own(self, f: StoredFactor, keep: bool = True) -> Tensor:
        """``f.data``, made writable: a lent ``data`` (a snapshot in flight reads it) is left
        to the snapshot and replaced by ``f.spare`` (or a new tensor), into which its values
        are copied when ``keep`` (an in-place update follows; a device flush that writes every
        entry from the old ones passes False)."""
        if f.lent:
            fresh = f.spare if f.spare is not None else torch.empty(
                f.data.shape, dtype=self.storage_dtype, pin_memory=self._pinned)
            if keep:
                fresh.copy_(f.data)
            f.data, f.spare, f.lent = fresh, None, False
        return f.data

    def spare_bytes(self) -> int:
        """Bytes of the spares held (memory beyond the stored factors, kept for the writes
        that come while a snapshot holds the stored tensors)."""
        return sum(f.spare.numel() * f.spare.element_size()
                   for f in self._factors.values() if f.spare is not None)

    def release(self, lent: Mapping[str, Tensor]) -> None:
        """The snapshot that held ``lent`` (``{key: data}`` of `state_dict` with ``lend``) is
        written: a factor still stored there is writable again, another's tensor becomes its
        spare. Call it where no flush runs (the tracker: after waiting for its worker)."""
        for key, t in lent.items():
            f = self._factors.get(key)
            if f is None:
                continue
            if f.data is t:
                f.lent = False
            elif f.spare is None and t.shape == f.data.shape:
                f.spare = t

    def add(self, key: str, dim: int, diagonal: bool) -> None:
        """Allocate a zero factor ``[dim, dim]`` (or ``[dim]`` if diagonal)."""
        shape = (dim,) if diagonal else (dim, dim)
        self._factors[key] = StoredFactor(self._alloc(shape), diagonal=diagonal)
        self._planned = False

    def __contains__(self, key: object) -> bool:
        return key in self._factors

    def copy_factor(self, source: str, key: str) -> None:
        """Add ``key`` as a copy of the factor ``source``: the same data, scale, EMA weight,
        counts and pending updates (not folded here, so both fold on the schedule they would
        have had apart, bit for bit), for a shared A split into its members' own
        (`Tracker.dissolve_groups`)."""
        f = self._factors[source]
        data = self._alloc(tuple(f.data.shape))
        data.copy_(f.data)
        self._factors[key] = dataclasses.replace(
            f, data=data, pending=list(f.pending), lent=False, spare=None,
            device=None if f.device is None else f.device.clone(),
            fz=None if f.fz is None else f.fz.clone())
        self._planned = False
        self._count_resident()

    def keys(self) -> list[str]:
        """The owned factors' keys, in the order they were added."""
        return list(self._factors)

    def pending_updates(self, key: str) -> int:
        """Updates of ``key`` recorded but not yet folded into its stored entries."""
        f = self._factors[key]
        return len(f.pending) + f.device_updates

    def is_resident(self, key: str) -> bool:
        """``key``'s pending statistic stays on the device between updates."""
        self._plan_residency()
        return self._factors[key].resident

    # -- state -----------------------------------------------------------------------------------

    def state_dict(self, lend: bool = False) -> dict[str, FactorState]:
        """Every owned factor, flushed, as a `FactorState`.

        Args:
            lend: The states hold the stored tensors themselves, no copy (a snapshot's, on the
                training thread: nothing is copied on the host, and the flush writes each
                factor once); each stays with its holder, unchanged, until `release`: a write
                before that goes into another tensor (`StoredFactor.lent`). False: copies.
        """
        self.flush()
        out = {}
        for key, f in self._factors.items():
            if lend:
                data, f.lent = f.data, True
            else:
                data = self._alloc(tuple(f.data.shape))
                data.copy_(f.data)
            out[key] = FactorState(data, f.scale, f.amax, f.weight, f.updates, f.positions,
                                   f.diagonal, float(f.sq_norm_sum), f.weight_sq,
                                   self._spread(key, f), self._sq_frob(f),
                                   None if f.fz is None else f.fz.to("cpu", torch.float64))
        return out

    def _spread(self, key: str, f: StoredFactor) -> float:
        """``Q/w − ‖F Z‖²/p`` (diagonal: ``Q/w − ‖F‖²``), NaN before any recorded update;
        ``F Z`` is the kept sketch (``[d, p]``): no pass over the factor's entries."""
        q = float(f.sq_norm_sum)
        if f.weight <= 0.0 or q <= 0.0:
            return math.nan
        if f.diagonal:
            return q / f.weight - self._sq_frob(f)
        if f.fz is None:  # a state restored from an older version: from the stored entries
            return q / f.weight - _sq_norm(f.data, f.scale, probes(key, f.data.shape[0]))
        return q / f.weight - float(f.fz.double().square().sum()) / f.fz.shape[1]

    @staticmethod
    def _sq_frob(f: StoredFactor) -> float:
        """``‖F‖²_F`` of the stored factor (from its last fold; computed for a factor never
        folded here, e.g. restored from an older state)."""
        if math.isnan(f.sq_frob):
            f.sq_frob = _sq_norm(f.data, f.scale)
        return f.sq_frob

    def load_state_dict(self, states: Mapping[str, FactorState]) -> None:
        """Replace every owned factor by its state in ``states`` (which may hold more keys);
        pending updates are dropped.

        Raises:
            KeyError: an owned factor is missing from ``states``.
            ValueError: a state of another shape or diagonality.
        """
        for key, f in self._factors.items():
            if key not in states:
                raise KeyError(f"factor {key!r} is not in the state")
            st = states[key]
            if tuple(st.data.shape) != tuple(f.data.shape) or st.diagonal != f.diagonal:
                raise ValueError(f"factor {key!r}: state of shape {tuple(st.data.shape)} "
                                 f"(diagonal={st.diagonal}), stored {tuple(f.data.shape)} "
                                 f"(diagonal={f.diagonal})")
        self._settle()
        for key, f in self._factors.items():
            st = states[key]
            self._own(f, keep=False).copy_(st.data)
            f.scale, f.amax, f.weight = float(st.scale), float(st.amax), float(st.weight)
            f.updates, f.positions = int(st.updates), int(st.positions)
            f.sq_norm_sum, f.weight_sq = float(st.sq_norm_sum), float(st.weight_sq)
            f.sq_frob = float(st.sq_frob)
            f.fz = None if st.sketch is None else st.sketch.to(torch.float64).clone()
            if f.fz is None and not f.diagonal and f.weight > 0:  # an older state: F_stored Z
                z = probes(key, f.data.shape[0])
                f.fz = torch.cat([f.data[i:i + CHUNK_ROWS].double() * f.scale @ z
                                  for i in range(0, f.data.shape[0], CHUNK_ROWS)])
            f.pending = []
            if f.device is not None:
                f.device.empty = True
            f.recompute_trace()

    def traces(self) -> dict[str, float]:
        """``{key: trace}`` of every owned factor without flushing (cheap: for monitoring
        between snapshots; consistent while the worker folds): the device path's pending
        statistics included as of the last update applied (`end_update`); the host path's
        pending rows are not (a host fold every ``flush_every`` updates)."""
        return {key: f.trace() for key, f in self._factors.items()}

    def _record(self, f: StoredFactor, n: float, positions: int, decay: float | None,
                sq_norm: float | Tensor, sz: Tensor | None = None) -> float:
        """Advance ``f``'s EMA weight and counts by one update of weight ``n`` whose statistic
        ``S`` has squared Frobenius norm ``sq_norm`` (with this update's ``λ``: ``decay``, or
        the store's ``ema_decay`` when None), and the sketch ``F Z`` by ``S Z`` (``sz``,
        ``[d, p]``, dense factors); returns ``η``."""
        lam = self.ema_decay if decay is None else decay
        f.weight, eta = ema_step(f.weight, n, lam)
        if sz is not None:  # F Z ← (1-η)·F Z + η·S Z, on the device of the update
            sz = sz.to(torch.float64)
            if f.fz is None or eta >= 1.0:
                f.fz = sz * eta
            else:
                f.fz = f.fz.to(sz.device).mul_(1.0 - eta).add_(sz, alpha=eta)
        f.sq_norm_sum = f.sq_norm_sum * lam + sq_norm * n  # sq_norm: ‖S Z‖²/p (or ‖S‖²)
        f.weight_sq = f.weight_sq * lam * lam + n * n
        f.updates += 1
        f.positions += int(positions)
        return eta

    # -- host path -------------------------------------------------------------------------------

    def push_rows(self, key: str, rows: Tensor, n: float | None = None,
                  positions: int | None = None, decay: float | None = None) -> None:
        """Record one update whose statistic is ``S = rowsᵀ rows / n`` (host path).

        Args:
            key: Factor key.
            rows: ``[m, d]`` (the bias column already appended for A factors), each row
                already multiplied by the square root of its sampling weight.
            n: Total weight of the rows (``> 0``; default ``m``: unweighted rows).
            positions: Sampled positions behind the rows (default ``m``), for the counts.
            decay: This update's ``λ`` (None: ``ema_decay``; ``0`` restarts the average).
        """
        f = self._factors[key]
        n = float(rows.shape[0]) if n is None else float(n)
        sz = None
        if f.diagonal:
            sq = rows.double().square().sum(0).square().sum() / (n * n)
        else:  # S Z = rowsᵀ (rows Z) / n: 2·m·d·p flops, in the rows' dtype
            z = self._probes_on(key, rows).to(rows.dtype)  # [d, p]
            sz = rows.T @ (rows @ z) / n
            sq = _sketch(sz)
        eta = self._record(f, n, rows.shape[0] if positions is None else positions, decay,
                           float(sq), sz)
        f.pending.append((rows.to(device="cpu", dtype=self.compute_dtype), eta, n))
        limit = 256 if f.diagonal else f.data.shape[0]
        if len(f.pending) >= self.flush_every or f.pending_rows >= limit:
            self._flush(f)

    def update(self, key: str, stat: Tensor, n: float, positions: int | None = None,
               decay: float | None = None) -> None:
        """Fold one step statistic given as a matrix (host path).

        Args:
            key: Factor key.
            stat: ``S`` (the mean), ``[d, d]`` (symmetric PSD) or ``[d]`` (moved to CPU here).
            n: Weight of the positions ``S`` was built from (``> 0``).
            positions: Sampled positions (default ``n``), for the counts.
            decay: This update's ``λ`` (None: ``ema_decay``; ``0`` restarts the average).
        """
        f = self._factors[key]
        self._flush(f)
        st = stat.double()
        sz = None if f.diagonal else st @ self._probes_on(key, st)
        sq = st.square().sum() if f.diagonal else _sketch(sz)
        eta = self._record(f, n, n if positions is None else positions, decay, float(sq), sz)
        stat = stat.to(device="cpu", dtype=self.compute_dtype) * eta
        self._fold(f, 1.0 - eta, stat=stat)

    # -- device path -----------------------------------------------------------------------------

    def push_device(self, key: str, payload: Tensor, how: str, n: float, positions: int,
                    decay: float | None = None) -> None:
        """Record one update on the device path: device kernels only, nothing read on the
        host (`device_fold.accumulate`).

        Args:
            key: Factor key.
            payload: ``how="rows"``: weighted rows ``[m, d]`` (``S = rowsᵀrows / n``);
                ``how="stats"``: the summed statistic ``Σ_s w_s x_s x_sᵀ`` ``[d, d]`` (or its
                diagonal ``[d]``), ``S = payload / n``; on the store's device.
            n: Total weight (``> 0``).
            positions: Sampled positions behind it, for the counts.
            decay: This update's ``λ`` (None: ``ema_decay``; ``0`` restarts the average).

        A resident factor's statistic stays on the device until a reader flushes; a factor
        the budget left off the device is folded into the host store at once (its flush is
        read at `end_update`).
        """
        f = self._factors[key]
        self._plan_residency()
        if f.pending:
            self._flush(f)  # rows and device statistics never pend together
        sq, sz = self._sq_norm_of(key, payload, how, f.diagonal)
        eta = self._record(f, n, positions, decay, sq / (float(n) ** 2),
                           None if sz is None else sz / float(n))
        try:
            p = self._pending_of(f, payload.device)
            accumulate(p, payload, how, eta, float(n), f.diagonal, self.traffic)
        except torch.OutOfMemoryError:
            self._shrink_budget(key)
            p = self._pending_of(f, payload.device)
            accumulate(p, payload, how, eta, float(n), f.diagonal, self.traffic)
        if not f.resident:
            self.traffic.budget_flushes += 1
            self._queue_fold(f)
            f.device = None  # a temporary: freed once its chunks are queued
            self._count_resident()

    def _sq_norm_of(self, key: str, payload: Tensor, how: str, diagonal: bool
                    ) -> tuple[Tensor, Tensor | None]:
        """``(‖S Z‖²/p, S Z)`` of the summed statistic ``S`` (a device scalar and ``[d, p]``;
        a diagonal factor: ``(‖S‖², None)``), from the rows when there are rows
        (``Xᵀ(XZ)``, never a ``d²`` copy)."""
        wide = torch.float64 if payload.dtype == torch.float64 else torch.float32
        if diagonal:
            s = payload.to(wide).square().sum(0) if how == "rows" else payload
            return s.double().square().sum(), None
        z = self._probes_on(key, payload).to(wide)
        if how == "rows":
            x = payload.to(wide)
            sz = x.T @ (x @ z)
        else:
            sz = payload.to(wide) @ z
        return _sketch(sz), sz

    def _pending_of(self, f: StoredFactor, device: torch.device) -> DevicePending:
        if f.device is None:
            # zeros, not empty: the first accumulation (beta=0) never meets a non-finite entry
            f.device = DevicePending(torch.zeros(tuple(f.data.shape), dtype=self.compute_dtype,
                                                 device=device))
            self._count_resident()
        return f.device

    def _plan_residency(self) -> None:
        """Decide once (and again after factors are added) which factors keep their pending
        statistic on the device: largest first, while their bytes and the accumulation's
        work space (`_work_space`) fit the budget."""
        if self._planned or self.device is None:
            return
        if self.device_budget is None:
            self.device_budget = cuda_budget(self.device) if self.device.type == "cuda" \
                else 0
        budget = int(self.device_budget) - self._work_space()
        esize = self.compute_dtype.itemsize
        used = 0
        for f in sorted(self._factors.values(), key=lambda f: -f.data.numel()):
            need = f.data.numel() * esize
            f.resident = used + need <= budget
            used += need if f.resident else 0
        self.traffic.device_budget = int(self.device_budget)
        self._planned = True

    def _work_space(self) -> int:
        """Device bytes the accumulation and flush use beyond the resident statistics: the
        largest factor's float32 Gram (16-bit rows) and the flush's buffer slots."""
        largest = max((f.data.numel() for f in self._factors.values()), default=0)
        return 4 * largest + 4 * CHUNK_ENTRIES * 4

    def _count_resident(self) -> None:
        esize = self.compute_dtype.itemsize
        now = sum(f.device.data.numel() * esize for f in self._factors.values()
                  if f.device is not None)
        self.traffic.resident_bytes = now
        self.traffic.peak_resident_bytes = max(self.traffic.peak_resident_bytes, now)

    def _shrink_budget(self, key: str) -> None:
        """The device ran out of memory while accumulating: fold every pending statistic into
        the host store, free them, halve the budget and plan again (logged)."""
        self.flush()
        for f in self._factors.values():
            f.device = None
        self._count_resident()
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.empty_cache()
        old = int(self.device_budget or 0)
        self.device_budget = old // 2
        self._planned = False
        self._plan_residency()
        logger.warning("kfac_stream: the device ran out of memory while accumulating %s; its "
                       "pending statistics were folded into the host store and the device "
                       "budget halved (%d -> %d bytes); set KFACConfig.device_memory_budget "
                       "to fix it", key, old, self.device_budget)

    def _queue_fold(self, f: StoredFactor) -> None:
        """Issue ``f``'s device flush (copies and kernels; read at `_settle`): into place, or
        from a lent ``data`` into the tensor that replaces it (`_own`)."""
        p = f.device
        if p is None or p.empty:
            return
        if self._lanes is None:
            self._lanes = make_lanes(p.data.device, self.storage_dtype,
                                     [(g.data.shape[0], g.diagonal)
                                      for g in self._factors.values()])
        src = f.data
        dst = self._own(f, keep=False)  # src itself unless a snapshot holds it
        result = stream_fold(src, f.scale, f.amax, p, f.diagonal, self._lanes, self.traffic,
                             out=None if dst is src else dst)
        self._queued.append((f, result))
        p.empty, p.updates, p.s, p.alpha = True, 0, 1.0, 1.0
        self.traffic.factor_flushes += 1

    def _settle(self) -> None:
        """Read every queued fold's scale, diagonal maximum and trace (one host read, after
        the last copy back), and the factors' ``‖S Z‖²`` sums."""
        if not self._queued:
            return
        queued, self._queued = self._queued, []
        lanes, self._lanes = self._lanes, None
        lanes.finish()
        sq = [f.sq_norm_sum for f, _ in queued if isinstance(f.sq_norm_sum, Tensor)]
        vals = torch.stack([v.to(torch.float64) for _, r in queued
                            for v in (r.exponent, r.diag_max, r.trace, r.sq_frob)]
                           + [s.to(torch.float64) for s in sq]).tolist()
        self.traffic.flushes += 1
        self.traffic.flush_syncs += 1
        it = iter(vals[4 * len(queued):])
        for i, (f, _) in enumerate(queued):
            e, top, tr, frob = vals[4 * i:4 * i + 4]
            scale = 2.0 ** e if f.data.dtype == torch.float16 else 1.0
            f.scale, f.amax, f.sq_frob = scale, top * scale, frob * scale * scale
            if isinstance(f.sq_norm_sum, Tensor):
                f.sq_norm_sum = next(it)
            f.folded_trace = tr * scale
            f.live_trace = None

    def end_update(self) -> None:
        """After an update's `push_device` calls: read the folds the budget forced (one read)
        and refresh the live traces of the resident factors (one read of their pending
        traces), so `traces` sees the update. On the updater's worker (CUDA: its stream)."""
        self._settle()
        live = [f for f in self._factors.values() if f.device_updates]
        if not live:
            return
        vals = torch.stack([(f.device.data if f.diagonal else f.device.data.diagonal())
                            .sum().to(torch.float64) for f in live]).tolist()
        for f, v in zip(live, vals):
            f.live_trace = f.device.alpha * f.folded_trace + f.device.s * v

    def _probes_on(self, key: str, like: Tensor) -> Tensor:
        """`probes` of ``key`` on ``like``'s device, made once per factor and device."""
        z = self._probe_cache.get(key)
        if z is None or z.device != like.device:
            z = self._probe_cache[key] = probes(key, like.shape[-1], like.device)
        return z

    # -- folding into the store ------------------------------------------------------------------

    def flush(self) -> None:
        """Fold every pending update into the stored factors (device path: one flush, one
        host read, for all of them)."""
        for f in self._factors.values():
            self._flush(f)
            self._queue_fold(f)
        self._settle()

    def _flush(self, f: StoredFactor) -> None:
        """Fold ``f``'s pending host rows (host path)."""
        if not f.pending:
            return
        m = f.pending_rows
        y = torch.empty(m, f.data.shape[0], dtype=self.compute_dtype)  # [m, d]
        tail, end = 1.0, m
        for rows, eta, n in reversed(f.pending):  # coef_k = η_k Π_{i>k} (1-η_i)
            k = rows.shape[0]
            torch.mul(rows, math.sqrt(eta * tail / n), out=y[end - k:end])
            tail *= 1.0 - eta
            end -= k
        f.pending = []
        self._fold(f, tail, y=y)

    def _fold(self, f: StoredFactor, alpha: float, *, y: Tensor | None = None,
              stat: Tensor | None = None) -> None:
        """``F ← alpha·F + YᵀY`` (``y``: ``[m, d]``) or ``F ← alpha·F + stat`` on the host.

        Both terms and ``F`` are PSD, so ``max|F_ij| = max_i F_ii``: the FP16 scale is chosen
        from the diagonals alone. The dense update is one fused ``addmm`` per chunk of rows
        (``beta·F + gamma·YᵀY``, the rescaling folded into ``beta``/``gamma``) over the upper
        triangle only, mirrored below: half the flops of a full ``YᵀY``, and a stored factor
        that is exactly symmetric.
        """
        cd = self.compute_dtype
        self._own(f)  # in place from here: a lent data is copied first
        term_diag = y.square().sum(0) if y is not None else (
            stat if f.diagonal else stat.diagonal())  # [d]
        bound = alpha * f.amax + float(term_diag.abs().max())
        fp16 = self.storage_dtype == torch.float16
        new_scale = 2.0 ** fp16_exponent(bound) if fp16 and bound > 0 else 1.0
        beta, gamma = f.scale * alpha / new_scale, 1.0 / new_scale
        self.traffic.host_entries += host_fold_entries(f.data.shape[0], f.diagonal)
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

    def values(self) -> dict[str, Tensor]:
        """All factors, flushed and dequantised (float32, or float64 for float64 storage)."""
        self.flush()
        return {k: f.value() for k, f in self._factors.items()}
