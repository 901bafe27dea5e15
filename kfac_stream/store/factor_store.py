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

Two ways in, by where the statistics were folded (``KFACConfig.fold_on``):

* **rows** (`push_rows`, CPU training): the weighted rows of an update, folded here with the
  deferred fold below;
* **device statistics** (`push_stat`, the rows' accelerator): the summed statistic
  ``Σ w xxᵀ`` of an update, already folded on the device. Up to ``flush_every`` updates are
  combined *on the device* into one pending fp32 sum (the EMA is linear:
  ``P ← (1-η)P + η S``, ``α ← α(1-η)``) while the pending sums of all owned factors fit
  ``device_budget`` bytes; then one device→host copy through a pinned staging buffer
  (allocated once, reused for every factor) and one ``F ← α·F + P`` pass over the stored
  entries. Without the budget every update is shipped at once.

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
import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..enums import StorageDtype
from ..stats.ema import ema_step
from ..stats.fp16 import fp16_exponent

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
            from which `sampling_error` follows.
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
        f2 = _sq_norm(self.data, self.scale)
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
        data: ``[d, d]`` (dense) or ``[d]`` (diagonal) in the storage dtype.
        scale: ``F = scale · data`` (1.0 unless float16).
        amax: Bound on the largest ``|F|`` entry, used to choose the next scale.
        weight: EMA weight ``w`` (includes pending updates).
        updates: Number of updates (including pending ones).
        positions: Number of positions (rows) over all updates.
        diagonal: Whether only the diagonal is kept.
        pending: ``[(rows [m, d], eta, n)]`` not yet folded into ``data`` (weighted rows:
            ``S = rowsᵀrows / n``).
        sq_norm_sum, weight_sq: See `FactorState`; ``sq_norm_sum`` is a 0-dim device tensor
            while device statistics add to it (read when the factor is exported).
        device_pending: ``Σ`` of pending device statistics (fp32, ``[d, d]`` or ``[d]``, on the
            rows' device) with ``device_alpha`` = ``Π (1-η)`` over them; None when empty.
        device_updates: Updates in ``device_pending``.
        folded_trace: ``scale · Σ diag(data)`` as of the last completed fold: set in one
            assignment when a fold has written every entry and the scale, so a reader on
            another thread (monitoring between snapshots) never sees a half-written factor.
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
    device_pending: Tensor | None = None
    device_alpha: float = 1.0
    device_updates: int = 0
    folded_trace: float = 0.0

    @property
    def pending_rows(self) -> int:
        """Rows waiting to be folded in."""
        return sum(r.shape[0] for r, _, _ in self.pending)

    def value(self, dtype: torch.dtype | None = None) -> Tensor:
        """Dequantised folded factor, ``[d, d]`` or ``[d]``, float32 (float64 if stored so)."""
        return _dequantise(self.data, self.scale, dtype)

    def trace(self) -> float:
        """``scale · Σ diag(data)``: the trace as of the last completed fold (pending updates
        not in it); safe to call while another thread folds (`folded_trace`)."""
        return self.folded_trace

    def recompute_trace(self) -> None:
        """Set `folded_trace` from ``data`` and ``scale`` (after a fold or a load)."""
        diag = self.data if self.diagonal else self.data.diagonal()
        self.folded_trace = float(diag.double().sum()) * self.scale


#: Gaussian probes per dense factor for its spread (`FactorState.spread`): the sketch's
#: relative error is about ``sqrt(2 / (p · effective rank))``
PROBES = 8


def probes(key: str, d: int, device=None) -> Tensor:
    """The factor's fixed probes ``Z [d, p]`` (float64), the same on every rank and after a
    resume: ``p = PROBES`` Gaussian columns from a generator seeded by the key's CRC32, or the
    identity (``p = d``: exact) when ``d ≤ 4·PROBES``. Fixed probes make the spread of one
    factor a sketch whose relative error is about ``sqrt(2 / (p · effective rank))``."""
    if d <= 4 * PROBES:
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
        flush_every: Fold pending updates after this many (default 8).
        device_budget: Bytes of device memory the pending device statistics may take (all
            owned factors together, fp32); 0 ships every device statistic at once.
    """

    def __init__(self, storage_dtype: str, ema_decay: float, flush_every: int = 8,
                 device_budget: int = 0) -> None:
        dtype = StorageDtype(storage_dtype)
        self.storage_dtype = dtype.torch_dtype
        self.compute_dtype = dtype.compute_dtype
        self.ema_decay = float(ema_decay)
        self.flush_every = int(flush_every)
        self.device_budget = int(device_budget)
        self._factors: dict[str, StoredFactor] = {}
        self._staging: Tensor | None = None  # pinned host buffer for device statistics
        self._pending_bytes = 0  # fp32 bytes of a pending device sum for every owned factor
        self._probe_cache: dict[str, Tensor] = {}  # device probes of push_stat

    def add(self, key: str, dim: int, diagonal: bool) -> None:
        """Allocate a zero factor ``[dim, dim]`` (or ``[dim]`` if diagonal)."""
        shape = (dim,) if diagonal else (dim, dim)
        self._factors[key] = StoredFactor(torch.zeros(shape, dtype=self.storage_dtype),
                                          diagonal=diagonal)
        self._pending_bytes += 4 * math.prod(shape)

    def __contains__(self, key: object) -> bool:
        return key in self._factors

    def copy_factor(self, source: str, key: str) -> None:
        """Add ``key`` as a copy of the factor ``source``: the same data, scale, EMA weight,
        counts and pending updates (not folded here, so both fold on the schedule they would
        have had apart, bit for bit), for a shared A split into its members' own
        (`Tracker.dissolve_groups`)."""
        f = self._factors[source]
        self._factors[key] = dataclasses.replace(
            f, data=f.data.clone(), pending=list(f.pending),
            device_pending=None if f.device_pending is None else f.device_pending.clone())
        self._pending_bytes += 4 * f.data.numel()

    def keys(self) -> list[str]:
        """The owned factors' keys, in the order they were added."""
        return list(self._factors)

    def pending_updates(self, key: str) -> int:
        """Updates of ``key`` recorded but not yet folded into its stored entries."""
        f = self._factors[key]
        return len(f.pending) + f.device_updates

    # -- state -----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, FactorState]:
        """Every owned factor, flushed, as a `FactorState` holding a copy of its data."""
        self.flush()
        return {key: FactorState(f.data.clone(), f.scale, f.amax, f.weight, f.updates,
                                 f.positions, f.diagonal, float(f.sq_norm_sum), f.weight_sq,
                                 self._spread(key, f)) for key, f in self._factors.items()}

    def _spread(self, key: str, f: StoredFactor) -> float:
        """``Q/w − ‖F Z‖²/p`` (diagonal: ``Q/w − ‖F‖²``), NaN before any recorded update."""
        q = float(f.sq_norm_sum)
        if f.weight <= 0.0 or q <= 0.0:
            return math.nan
        z = None if f.diagonal else probes(key, f.data.shape[0])
        return q / f.weight - _sq_norm(f.data, f.scale, z)

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
        for key, f in self._factors.items():
            st = states[key]
            f.data.copy_(st.data)
            f.scale, f.amax, f.weight = float(st.scale), float(st.amax), float(st.weight)
            f.updates, f.positions = int(st.updates), int(st.positions)
            f.sq_norm_sum, f.weight_sq = float(st.sq_norm_sum), float(st.weight_sq)
            f.pending, f.device_pending, f.device_alpha, f.device_updates = [], None, 1.0, 0
            f.recompute_trace()

    def traces(self) -> dict[str, float]:
        """``{key: trace}`` of every owned factor as of its last completed fold, without
        flushing (cheap: for monitoring between snapshots; consistent while the worker
        folds)."""
        return {key: f.trace() for key, f in self._factors.items()}

    def _record(self, f: StoredFactor, n: float, positions: int, decay: float | None,
                sq_norm: float | Tensor) -> float:
        """Advance ``f``'s EMA weight and counts by one update of weight ``n`` whose statistic
        has squared Frobenius norm ``sq_norm`` (with this update's ``λ``: ``decay``, or the
        store's ``ema_decay`` when None); returns ``η``."""
        lam = self.ema_decay if decay is None else decay
        f.weight, eta = ema_step(f.weight, n, lam)
        f.sq_norm_sum = f.sq_norm_sum * lam + sq_norm * n  # sq_norm: ‖S Z‖²/p (or ‖S‖²)
        f.weight_sq = f.weight_sq * lam * lam + n * n
        f.updates += 1
        f.positions += int(positions)
        return eta

    def push_rows(self, key: str, rows: Tensor, n: float | None = None,
                  positions: int | None = None, decay: float | None = None) -> None:
        """Record one update whose statistic is ``S = rowsᵀ rows / n``.

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
        if f.diagonal:
            sq = rows.double().square().sum(0).square().sum() / (n * n)
        else:  # S Z = rowsᵀ (rows Z) / n: 2·m·d·p flops, in the rows' dtype
            z = self._probes_on(key, rows).to(rows.dtype)  # [d, p]
            sq = _sketch(rows.T @ (rows @ z)) / (n * n)
        eta = self._record(f, n, rows.shape[0] if positions is None else positions, decay,
                           float(sq))
        f.pending.append((rows.to(device="cpu", dtype=self.compute_dtype), eta, n))
        limit = 256 if f.diagonal else f.data.shape[0]
        if len(f.pending) >= self.flush_every or f.pending_rows >= limit:
            self._flush(f)

    def update(self, key: str, stat: Tensor, n: float, positions: int | None = None,
               decay: float | None = None) -> None:
        """Fold one step statistic given as a matrix.

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
        sq = st.square().sum() if f.diagonal else _sketch(st @ self._probes_on(key, st))
        eta = self._record(f, n, n if positions is None else positions, decay, float(sq))
        stat = stat.to(device="cpu", dtype=self.compute_dtype) * eta
        self._fold(f, 1.0 - eta, stat=stat)

    def push_stat(self, key: str, stat_sum: Tensor, n: float, positions: int,
                  decay: float | None = None) -> None:
        """Record one update given as a summed statistic on the rows' device.

        Args:
            key: Factor key.
            stat_sum: ``Σ_s w_s x_s x_sᵀ`` (``[d, d]``) or its diagonal (``[d]``), float32 (or
                float64 for float64 storage), on any device; ``S = stat_sum / n``.
            n: Total weight (``> 0``).
            positions: Sampled positions behind it, for the counts.
            decay: This update's ``λ`` (None: ``ema_decay``; ``0`` restarts the average).

        Kept on the device and combined with the following ones (see the module docstring)
        while the budget allows; the caller must not modify ``stat_sum`` afterwards.
        """
        f = self._factors[key]
        self._flush(f)  # rows and device statistics never pend together
        # ‖S Z‖²/p stays a device scalar (no host read here); read when the factor is exported
        st = stat_sum.double()
        sq = (st.square().sum() if f.diagonal else
              _sketch(st @ self._probes_on(key, st))) / (float(n) ** 2)
        eta = self._record(f, n, positions, decay, sq)
        term = stat_sum.to(self.compute_dtype).mul_(eta / float(n))
        if f.device_pending is None:
            f.device_pending, f.device_alpha = term, 1.0 - eta
        else:
            f.device_pending.mul_(1.0 - eta).add_(term)
            f.device_alpha *= 1.0 - eta
        f.device_updates += 1
        if f.device_updates >= self.flush_every or self._pending_bytes > self.device_budget:
            self._flush(f)

    def _probes_on(self, key: str, like: Tensor) -> Tensor:
        """`probes` of ``key`` on ``like``'s device, made once per factor and device."""
        z = self._probe_cache.get(key)
        if z is None or z.device != like.device:
            z = self._probe_cache[key] = probes(key, like.shape[-1], like.device)
        return z

    def flush(self) -> None:
        """Fold every pending update into the stored factors."""
        for f in self._factors.values():
            self._flush(f)

    def _host_copy(self, t: Tensor) -> Tensor:
        """``t`` on the CPU: through one pinned staging buffer (grown to the largest factor,
        then reused) for device tensors; ``t`` itself on the CPU."""
        if t.device.type == "cpu":
            return t
        need = t.numel()
        if self._staging is None or self._staging.numel() < need or \
                self._staging.dtype != t.dtype:
            self._staging = torch.empty(need, dtype=t.dtype, pin_memory=True)
        buf = self._staging[:need].view(t.shape)
        buf.copy_(t, non_blocking=True)
        torch.cuda.current_stream(t.device).synchronize()  # the worker's stream, not training's
        return buf

    def _flush(self, f: StoredFactor) -> None:
        if f.device_pending is not None:
            stat, alpha = f.device_pending, f.device_alpha
            f.device_pending, f.device_alpha, f.device_updates = None, 1.0, 0
            self._fold(f, alpha, stat=self._host_copy(stat))
            if isinstance(f.sq_norm_sum, Tensor):  # ‖S Z‖² sums of push_stat: read here, after
                f.sq_norm_sum = float(f.sq_norm_sum)  # the copy's sync on the same stream
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
        """``F ← alpha·F + YᵀY`` (``y``: ``[m, d]``) or ``F ← alpha·F + stat``.

        Both terms and ``F`` are PSD, so ``max|F_ij| = max_i F_ii``: the FP16 scale is chosen
        from the diagonals alone. The dense update is one fused ``addmm`` per chunk of rows
        (``beta·F + gamma·YᵀY``, the rescaling folded into ``beta``/``gamma``) over the upper
        triangle only, mirrored below: half the flops of a full ``YᵀY``, and a stored factor
        that is exactly symmetric.
        """
        cd = self.compute_dtype
        term_diag = y.square().sum(0) if y is not None else (
            stat if f.diagonal else stat.diagonal())  # [d]
        bound = alpha * f.amax + float(term_diag.abs().max())
        fp16 = self.storage_dtype == torch.float16
        new_scale = 2.0 ** fp16_exponent(bound) if fp16 and bound > 0 else 1.0
        beta, gamma = f.scale * alpha / new_scale, 1.0 / new_scale
        if f.diagonal:
            new = f.data.to(cd).mul_(beta).add_(term_diag, alpha=gamma)  # [d]
            f.data.copy_(new)
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
                if stop < d:
                    f.data[stop:, start:stop].copy_(f.data[start:stop, stop:].T)
        else:
            for start in range(0, f.data.shape[0], CHUNK_ROWS):
                rows = slice(start, min(start + CHUNK_ROWS, f.data.shape[0]))
                f.data[rows].copy_(f.data[rows].to(cd) * beta + stat[rows] * gamma)
        diag = f.data if f.diagonal else f.data.diagonal()
        f.scale, f.amax = new_scale, float(diag.to(cd).abs().max()) * new_scale
        f.recompute_trace()  # one float assignment: readers see the old or the new trace

    def values(self) -> dict[str, Tensor]:
        """All factors, flushed and dequantised (float32, or float64 for float64 storage)."""
        self.flush()
        return {k: f.value() for k, f in self._factors.items()}
