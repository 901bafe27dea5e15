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

Two ways in, by where the statistics are folded (`kfac_stream.tracking.plan.RunPlan.fold_on`):

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
import math
from collections.abc import Mapping

import torch
from torch import Tensor

from ..stats.ema import ema_step
from ..utils.enums import StorageDtype
from . import host_fold
from .device_fold import DevicePending, FlushLanes, FoldResult, accumulate, make_lanes, stream_fold
from .device_groups import GroupRegistry
from .residency import Residency
from .stored_factor import CHUNK_ROWS, FactorState, StoredFactor, probes, sketch_sq_norm
from .stored_factor import sq_norm as _sq_norm  # the pass over the entries (tests replace it)
from .traffic import Traffic

__all__ = ["CHUNK_ROWS", "FactorState", "FactorStore", "StoredFactor", "probes"]


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
            at the first `push_device` (`kfac_stream.store.device_budget.cuda_budget`).
        traffic: Where the store counts its work (`Traffic`; the tracker passes its
            `Counters`).
        defer: Device path, factors folded as a group (`push_group`): updates whose rows are
            held before one fold into the pending sums (`device_groups`; 1: fold each), fewer
            while the held rows would leave the device budget.
        reserved: Bytes of ``device_budget`` other device state holds (`Residency`).
    """

    def __init__(self, storage_dtype: str, ema_decay: float, flush_every: int = 8,
                 device: torch.device | None = None, device_budget: int | None = 0,
                 traffic: Traffic | None = None, defer: int = 1, reserved: int = 0) -> None:
        dtype = StorageDtype(storage_dtype)
        self.storage_dtype = dtype.torch_dtype
        self.compute_dtype = dtype.compute_dtype
        self.ema_decay = float(ema_decay)
        self.flush_every = int(flush_every)
        self.device = None if device is None else torch.device(device)
        self.traffic = traffic if traffic is not None else Traffic()
        self._factors: dict[str, StoredFactor] = {}
        self._probe_cache: dict[str, Tensor] = {}  # device probes of push_device
        self._residency = Residency(self._factors, self.device, device_budget,
                                    self.compute_dtype, self.traffic, reserved)
        self._queued: list[tuple[StoredFactor, FoldResult]] = []  # folds issued, not read
        self._lanes: FlushLanes | None = None
        self._grouped = GroupRegistry(self.compute_dtype, self.traffic, defer)  # push_group's

    @property
    def device_budget(self) -> int | None:
        """The device budget in bytes (`residency.Residency.budget`; None: not decided yet)."""
        return self._residency.budget

    @device_budget.setter
    def device_budget(self, value: int | None) -> None:
        self._residency.budget = value

    @property
    def _planned(self) -> bool:  # the residency plan is made (cleared: plan again)
        return self._residency.planned

    @_planned.setter
    def _planned(self, value: bool) -> None:
        self._residency.planned = value

    def _work_space(self) -> int:
        """Device bytes beyond the resident statistics (`residency.Residency.work_space`)."""
        return self._residency.work_space()

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
        self._residency.planned = False

    def __contains__(self, key: object) -> bool:
        return key in self._factors

    def copy_factor(self, source: str, key: str) -> None:
        """Add ``key`` as a copy of the factor ``source``: the same data, scale, EMA weight,
        counts and pending updates (not folded here, so both fold on the schedule they would
        have had apart, bit for bit), for a shared A split into its members' own
        (`Tracker.dissolve_groups`)."""
        self._fold_held(source)
        f = self._factors[source]
        data = self._alloc(tuple(f.data.shape))
        data.copy_(f.data)
        self._factors[key] = dataclasses.replace(
            f, data=data, pending=list(f.pending), lent=False, spare=None,
            device=None if f.device is None else f.device.clone(),
            fz=None if f.fz is None else f.fz.clone(),
            sq_norm_sum=f.sq_norm_sum.clone() if isinstance(f.sq_norm_sum, Tensor)
            else f.sq_norm_sum)
        self._residency.planned = False
        self._residency.count()

    def keys(self) -> list[str]:
        """The owned factors' keys, in the order they were added."""
        return list(self._factors)

    def pending_updates(self, key: str) -> int:
        """Updates of ``key`` recorded but not yet folded into its stored entries."""
        f = self._factors[key]
        return len(f.pending) + f.device_updates

    def is_resident(self, key: str) -> bool:
        """``key``'s pending statistic stays on the device between updates."""
        self._residency.plan()
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
            out[key] = FactorState(
                data, f.scale, f.amax, weight=f.weight, updates=f.updates,
                positions=f.positions, diagonal=f.diagonal, sq_norm_sum=float(f.sq_norm_sum),
                weight_sq=f.weight_sq, spread=self._spread(f), sq_frob=self._sq_frob(f),
                sketch=None if f.fz is None else f.fz.to("cpu", torch.float64))
        return out

    def _spread(self, f: StoredFactor) -> float:
        """``Q/w − ‖F Z‖²/p`` (diagonal: ``Q/w − ‖F‖²``), NaN before any recorded update;
        ``F Z`` is the kept sketch (``[d, p]``): no pass over the factor's entries."""
        q = float(f.sq_norm_sum)
        if f.weight <= 0.0 or q <= 0.0:
            return math.nan
        if f.diagonal:
            return q / f.weight - self._sq_frob(f)
        return q / f.weight - float(f.fz.double().square().sum()) / f.fz.shape[1]

    @staticmethod
    def _sq_frob(f: StoredFactor) -> float:
        """``‖F‖²_F`` of the stored factor (from its last fold; computed for a factor never
        folded here)."""
        if math.isnan(f.sq_frob):
            f.sq_frob = _sq_norm(f.data, f.scale)
        return f.sq_frob

    def load_state_dict(self, states: Mapping[str, FactorState]) -> None:
        """Replace every owned factor by its state in ``states`` (which may hold more keys);
        pending updates are dropped.

        Raises:
            KeyError: an owned factor is missing from ``states``.
            ValueError: a state of another shape or diagonality, or a dense factor's state
                with updates but no sketch (``F Z``, kept since the first update).
        """
        for key, f in self._factors.items():
            if key not in states:
                raise KeyError(f"factor {key!r} is not in the state")
            st = states[key]
            if tuple(st.data.shape) != tuple(f.data.shape) or st.diagonal != f.diagonal:
                raise ValueError(f"factor {key!r}: state of shape {tuple(st.data.shape)} "
                                 f"(diagonal={st.diagonal}), stored {tuple(f.data.shape)} "
                                 f"(diagonal={f.diagonal})")
            if st.sketch is None and not st.diagonal and st.weight > 0:
                raise ValueError(f"factor {key!r}: state with updates but no sketch")
        self._settle()
        self._grouped.drop_held()
        for key, f in self._factors.items():
            st = states[key]
            self._own(f, keep=False).copy_(st.data)
            f.scale, f.amax, f.weight = float(st.scale), float(st.amax), float(st.weight)
            f.updates, f.positions = int(st.updates), int(st.positions)
            f.sq_norm_sum, f.weight_sq = float(st.sq_norm_sum), float(st.weight_sq)
            f.sq_frob = float(st.sq_frob)
            f.fz = None if st.sketch is None else st.sketch.to(torch.float64).clone()
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
            sq = sketch_sq_norm(sz)
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
        sq = st.square().sum() if f.diagonal else sketch_sq_norm(sz)
        eta = self._record(f, n, n if positions is None else positions, decay, float(sq), sz)
        stat = stat.to(device="cpu", dtype=self.compute_dtype) * eta
        self._fold(f, 1.0 - eta, stat=stat)

    # -- device path -----------------------------------------------------------------------------

    @property
    def defer(self) -> int:
        """Updates a group holds before one fold (`GroupRegistry.defer`)."""
        return self._grouped.defer

    @defer.setter
    def defer(self, value: int) -> None:
        self._grouped.defer = max(1, int(value))
        for group in self._grouped.groups.values():  # the groups made so far too
            group.defer = self._grouped.defer

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
        self._residency.plan()
        if f.pending:
            self._flush(f)  # rows and device statistics never pend together
        self._fold_held(key)
        sq, sz = self._sq_norm_of(key, payload, how, f.diagonal)
        eta = self._record(f, n, positions, decay, sq / (float(n) ** 2),
                           None if sz is None else sz / float(n))
        try:
            p = self._pending_of(f, payload.device)
            accumulate(p, payload, how, eta, float(n), diagonal=f.diagonal,
                       traffic=self.traffic)
        except torch.OutOfMemoryError:
            self._shrink(key)
            p = self._pending_of(f, payload.device)
            accumulate(p, payload, how, eta, float(n), diagonal=f.diagonal,
                       traffic=self.traffic)
        if not f.resident:
            self.traffic.budget_flushes += 1
            self._queue_fold(f)
            f.device = None  # a temporary: freed once its chunks are queued
            self._residency.count()

    def push_group(self, keys: tuple[str, ...], rows: Tensor, n: float, positions: int,
                   decay: float | None = None) -> None:
        """Record one update of the dense factors ``keys`` of one side, given as one stack of
        weighted rows ``[G, m, d]`` (member ``i``: ``S_i = rows[i]ᵀ rows[i] / n``), folded
        together (`device_groups.DeviceGroup`): the values of `push_device` per member, a
        fixed number of device ops. A member the budget leaves off the device, or a diagonal
        one, is pushed on its own.

        Args:
            keys: The members, in the order of the rows' first axis.
            rows: ``[G, m, d]`` on the store's device.
            n, positions, decay: As `push_device`'s (the same for every member).
        """
        self._residency.plan()
        members = [self._factors[k] for k in keys]
        if any(f.diagonal or not f.resident for f in members):
            self._grouped.drop(keys)
            for i, key in enumerate(keys):
                self.push_device(key, rows[i], "rows", n, positions, decay)
            return
        for f in members:
            if f.pending:
                self._flush(f)  # rows and device statistics never pend together
        try:
            fresh = keys not in self._grouped.groups
            group = self._grouped.group_of(keys, rows.shape[-1], rows.device)
            group.link(members)
            if fresh:
                self._residency.count()  # the members' pending sums are the group's now
        except torch.OutOfMemoryError:
            self._shrink(keys[0])
            for i, key in enumerate(keys):
                self.push_device(key, rows[i], "rows", n, positions, decay)
            return
        lam = self.ema_decay if decay is None else decay
        self._grouped.accumulate(group, members, rows, n=float(n), positions=positions,
                                 lam=lam, spare=self._residency.spare)

    def _fold_held(self, key: str | None = None) -> None:
        """Fold the held rows of ``key``'s group (None: of every group) into its pending
        sums: before a reader or a per-factor op on a member."""
        self._grouped.fold_held(key)

    def _shrink(self, key: str) -> None:
        """The device ran out of memory: drop the groups, fold and free every pending sum and
        halve the budget (`Residency.shrink`)."""
        self._residency.shrink(key, self.flush)
        self._grouped.clear()

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
        return sketch_sq_norm(sz), sz

    def _pending_of(self, f: StoredFactor, device: torch.device) -> DevicePending:
        if f.device is None:
            # zeros, not empty: the first accumulation (beta=0) never meets a non-finite entry
            f.device = DevicePending(torch.zeros(tuple(f.data.shape), dtype=self.compute_dtype,
                                                 device=device))
            self._residency.count()
        return f.device

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
        result = stream_fold(src, f.scale, f.amax, p, diagonal=f.diagonal, lanes=self._lanes,
                             traffic=self.traffic, out=None if dst is src else dst)
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
        live, parts = self._grouped.live_traces(self._factors)
        grouped = {id(f) for f in live}
        single = [f for f in self._factors.values() if f.device_updates and id(f) not in grouped]
        live += single
        parts += [(f.device.data if f.diagonal else f.device.data.diagonal())
                  .sum().to(torch.float64).reshape(1) for f in single]
        if not parts:
            return
        vals = torch.cat(parts).tolist()
        for f, v in zip(live, vals):
            if f.device_updates:
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
        self._fold_held()
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
        """``F ← alpha·F + YᵀY`` or ``F ← alpha·F + stat`` on the host (`host_fold.fold`)."""
        self._own(f)  # in place from here: a lent data is copied first
        host_fold.fold(f, alpha, y=y, stat=stat, compute_dtype=self.compute_dtype,
                       storage_dtype=self.storage_dtype, traffic=self.traffic)

    def values(self) -> dict[str, Tensor]:
        """All factors, flushed and dequantised (float32, or float64 for float64 storage)."""
        self.flush()
        return {k: f.value() for k, f in self._factors.items()}
