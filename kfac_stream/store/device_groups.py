r"""The device path's fold batched by shape: the dense factors one update delivers as one stack
of rows (``[G, m, d]``: ``G`` factors of side ``d``, ``m`` rows each) are folded together, a
fixed handful of device ops per group whatever ``G`` (`DeviceGroup.accumulate`).

A group owns one ``[G, d, d]`` tensor of pending sums ``P'`` (each member's
`device_fold.DevicePending` holds its slice as ``data``), one ``[G, d, p]`` float64 tensor of
the members' sketches ``F Z`` and one ``[G]`` float64 tensor of their ``Σ λ…‖S Z‖²/p`` sums
(`StoredFactor.fz` and ``sq_norm_sum`` are views of them). Per member, an update is exactly
what `device_fold.accumulate` and `FactorStore._record` do for one factor:

* ``P' ← keep·P' + c·XᵀX`` with ``c = η/(n·s)`` (``keep``: 0 for an empty pending sum or the
  window's restart, ``s·(1-η)`` when ``s`` is renormalised, else 1): one ``baddbmm`` for the
  group (16-bit rows on CUDA: tensor cores with float32 output where torch has that kernel);
* ``F Z ← (1-η)·F Z + η·Xᵀ(XZ)/n``: two ``bmm`` and one fused add for the group;
* ``Σ ← λ·Σ + ‖Xᵀ(XZ)‖²/(p·n)``.

Deferred Gram (``defer = K > 1``): the rows of up to ``K`` updates are held (``[G, m, d]``
each, as delivered) and added to ``P'`` in one GEMM over their concatenation, each update's
rows scaled by ``√(c_k · Π_{j>k} keep_j)`` and ``P'`` by ``Π_k keep_k``: the closed form of the
``K`` sequential updates, with one read-modify-write of the ``G·d²`` pending entries instead of
``K``. The sketch stays per update (its norm is not linear in the statistic); so does the
trace of what is held (``c·‖X‖²``, for the live traces). A reader (`fold_held`, called by every
flush and before any per-factor op on a member) folds what is held first.

The host bookkeeping (``η``, ``s``, ``α``, counts) stays per member in Python: no device op.
Members whose coefficients differ (their histories differ, e.g. after a budget flush) take
per-member coefficient vectors: a few more ops, the same values. A member whose slices were
replaced from outside (a load, a per-factor fold, a copied factor) is re-linked at its next
group update: its values are copied into the group's slices first.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..stats.ema import ema_step
from .device_fold import RENORM, DevicePending, probe_fused_16bit
from .fold_cost import accumulate_bytes, accumulate_flops, pending_rmw_bytes
from .stored_factor import StoredFactor, probes
from .traffic import Traffic

#: `batched_16bit` per device, probed once.
_BATCHED_16BIT: dict[str, bool] = {}


def batched_16bit(device: torch.device) -> bool:
    """Whether ``torch.baddbmm(acc, Xᵀ, X, out_dtype=float32, out=acc)`` with 16-bit ``X``
    runs on ``device`` and equals the float32 fold (probed once per device; the CPU build has
    no such kernel)."""
    key = str(device)
    if key not in _BATCHED_16BIT:
        _BATCHED_16BIT[key] = probe_fused_16bit(device, batch=(2,))
    return _BATCHED_16BIT[key]


def _one_or_vector(values: list[float], like: Tensor) -> float | Tensor:
    """``values[0]`` when every value is the same, else a tensor of them shaped to scale
    ``like`` member by member (``[G]`` for ``[G]``, ``[G, 1, 1]`` for ``[G, a, b]``)."""
    if all(v == values[0] for v in values):
        return values[0]
    t = torch.tensor(values, dtype=like.dtype).to(like.device, non_blocking=True)
    return t.reshape(-1, *[1] * (like.dim() - 1))


class DeviceGroup:
    """The pending sums, sketches and sketch norms of ``G`` dense factors of side ``d``.

    Args:
        keys: The members' keys, in the order of the rows' first axis.
        d: Their side.
        compute_dtype: The pending sums' dtype.
        device: Where they live.
        z: The members' probes ``[G, d, p]`` (float64).
    """

    def __init__(self, keys: tuple[str, ...], d: int, compute_dtype: torch.dtype,
                 device: torch.device, z: Tensor) -> None:
        g, p = len(keys), z.shape[-1]
        self.keys = keys
        self.acc = torch.zeros(g, d, d, dtype=compute_dtype, device=device)  # P' [G, d, d]
        self.fz = torch.zeros(g, d, p, dtype=torch.float64, device=device)  # F Z [G, d, p]
        self.sq = torch.zeros(g, dtype=torch.float64, device=device)  # Σ λ…‖S Z‖²/p [G]
        self.z = z.to(device)  # [G, d, p] float64
        self._z_as: dict[torch.dtype, Tensor] = {torch.float64: self.z}
        self.acc_views = self.acc.unbind(0)
        self.fz_views = self.fz.unbind(0)
        self.sq_views = self.sq.unbind(0)
        self.defer = 1  # updates whose Gram is held before one fold (`FactorStore.defer`)
        self.held: list[Tensor] = []  # [G, m_k, d] rows of the held updates
        self.held_coef: list[list[float]] = []  # per held update, per member: c_k Π_{j>k} keep_j
        self.base = [1.0] * g  # per member: Π keep over the held updates (P' ← base·P' + …)
        self.held_trace = torch.zeros(g, dtype=torch.float64, device=device)  # Σ c‖X‖² held
        # rows folded or dropped, kept referenced until the next update: the worker's stream
        # may still read them (they were allocated on the training's stream, which could
        # reuse their memory at once); the worker synchronises its stream after each update
        self._retired: list[Tensor] = []

    @property
    def held_bytes(self) -> int:
        """Device bytes of the held rows."""
        return sum(r.numel() * r.element_size() for r in self.held)

    def probes_as(self, dtype: torch.dtype) -> Tensor:
        """The probes in ``dtype`` (made once)."""
        if dtype not in self._z_as:
            self._z_as[dtype] = self.z.to(dtype)
        return self._z_as[dtype]

    def link(self, members: list[StoredFactor]) -> None:
        """Make every member's pending sum, sketch and sketch norm the group's slices, copying
        in the values of a member whose own were set elsewhere."""
        stale_sq: list[tuple[int, float | Tensor]] = []
        for i, f in enumerate(members):
            p = f.device
            if p is None:
                f.device = DevicePending(self.acc_views[i])
            elif p.data is not self.acc_views[i]:
                if not p.empty:
                    self.acc_views[i].copy_(p.data)
                p.data = self.acc_views[i]
            if f.fz is not self.fz_views[i]:
                if f.fz is None:
                    self.fz_views[i].zero_()
                else:
                    self.fz_views[i].copy_(f.fz)
                f.fz = self.fz_views[i]
            if f.sq_norm_sum is not self.sq_views[i]:
                stale_sq.append((i, f.sq_norm_sum))
                f.sq_norm_sum = self.sq_views[i]
        if stale_sq:
            self._write_sq(stale_sq)

    def _write_sq(self, stale: list[tuple[int, float | Tensor]]) -> None:
        if len(stale) == len(self.keys) and all(isinstance(v, float) for _, v in stale):
            self.sq.copy_(torch.tensor([v for _, v in stale], dtype=torch.float64),
                          non_blocking=True)
            return
        for i, v in stale:
            self.sq_views[i].copy_(torch.as_tensor(v, dtype=torch.float64))

    def accumulate(self, members: list[StoredFactor], rows: Tensor, n: float, positions: int,
                   *, lam: float, traffic: Traffic, fused_16bit: bool) -> None:
        """One update of weight ``n`` (``λ``: ``lam``) whose member ``i`` has the weighted rows
        ``rows[i]`` (``[G, m, d]``: ``S_i = rows[i]ᵀ rows[i] / n``), folded into the pending
        sums, sketches and norms; the members' host bookkeeping advanced."""
        self._retired = []
        keep, coef, eta = [], [], []
        for f in members:
            f.weight, e = ema_step(f.weight, n, lam)
            f.weight_sq = f.weight_sq * lam * lam + n * n
            f.updates += 1
            f.positions += int(positions)
            p = f.device
            beta = 1.0 - e
            if p.empty or beta == 0.0:
                k, s_new = 0.0, 1.0
            elif p.s * beta < RENORM:
                k, s_new = p.s * beta, 1.0
            else:
                k, s_new = 1.0, p.s * beta
            keep.append(k)
            coef.append(e / (n * s_new))
            eta.append(e)
            p.s = s_new
            p.alpha = beta if p.empty else p.alpha * beta
            p.updates = 1 if p.empty else p.updates + 1
            p.empty = False
        wide = torch.float64 if rows.dtype == torch.float64 else torch.float32
        x = rows.to(wide)  # [G, m, d]: 16-bit rows copied once, for the sketch (and the Gram
        # where no 16-bit batched kernel writes float32)
        self._sketch(x, n, lam, eta)
        if self.defer <= 1 and not self.held:
            self._gram(rows, x, keep, coef, fused_16bit)
            self._count(rows, traffic, deferred=False)
            return
        for held in self.held_coef:  # an earlier held update is scaled by this one's keep
            held[:] = [c * k for c, k in zip(held, keep)]
        self.base = [b * k for b, k in zip(self.base, keep)]
        self.held.append(rows)
        self.held_coef.append(coef)
        norms = x.square().sum((1, 2), dtype=torch.float64)  # [G] ‖X_i‖²
        held_keep = _one_or_vector(keep, self.held_trace)
        c = _one_or_vector(coef, self.held_trace)
        self.held_trace.mul_(held_keep)
        if isinstance(c, float):
            self.held_trace.add_(norms, alpha=c)
        else:
            self.held_trace.addcmul_(norms, c)
        self._count(rows, traffic, deferred=True)
        if len(self.held) >= self.defer:
            self.fold_held(fused_16bit, traffic)

    def fold_held(self, fused_16bit: bool, traffic: Traffic) -> None:
        """Add the held updates' Grams to ``P'`` (one GEMM over their rows, each scaled by
        its coefficient; ``P'`` by the product of their keeps) and drop them. The scaling is
        in the rows' dtype: 16-bit rows are rounded once more (≤ 2⁻⁹ relative per entry in
        bf16, the size of their own rounding when they were captured)."""
        if not self.held:
            return
        parts = []
        for rows, coef in zip(self.held, self.held_coef):
            if any(c != 0.0 for c in coef):
                root = _one_or_vector([math.sqrt(c) for c in coef], self.acc)
                parts.append(rows * (root if isinstance(root, float) else root.to(rows.dtype)))
        base = self.base
        self._retired += self.held
        self.held, self.held_coef, self.base = [], [], [1.0] * len(self.keys)
        self.held_trace.zero_()
        g, d = len(self.keys), self.acc.shape[-1]
        traffic.deferred_folds += g
        traffic.fold_device_bytes += g * pending_rmw_bytes(d, False, self.acc.element_size())
        if not parts:
            self._keep(base)
            return
        x = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # [G, Σm, d]
        self._gram(x, None, base, [1.0] * g, fused_16bit)

    def _keep(self, keep: list[float]) -> None:
        k = _one_or_vector(keep, self.acc)
        if not (isinstance(k, float) and k == 1.0):
            self.acc.mul_(k)

    def drop_held(self) -> None:
        """Forget the held updates (the pending sums are being dropped: a load)."""
        self._retired += self.held
        self.held, self.held_coef, self.base = [], [], [1.0] * len(self.keys)
        self.held_trace.zero_()

    def _sketch(self, x: Tensor, n: float, lam: float, eta: list[float]) -> None:
        """``F Z ← (1-η)·F Z + η·Xᵀ(XZ)/n`` and ``Σ ← λ·Σ + ‖Xᵀ(XZ)‖²/(p·n)`` from the rows
        ``x`` ``[G, m, d]`` in float32 (float64)."""
        wide = x.dtype
        sz = torch.bmm(x.mT, torch.bmm(x, self.probes_as(wide)))  # [G, d, p] = n·S Z
        p = sz.shape[-1]
        self.sq.mul_(lam).add_(sz.square().sum((1, 2), dtype=torch.float64), alpha=1.0 / (p * n))
        keep = _one_or_vector([1.0 - e for e in eta], self.fz)
        step = _one_or_vector([e / n for e in eta], self.fz)
        if isinstance(step, float):
            self.fz.mul_(keep).add_(sz, alpha=step)
        else:
            self.fz.mul_(keep).addcmul_(sz, step)

    def _gram(self, rows: Tensor, x: Tensor | None, keep: list[float], coef: list[float],
              fused_16bit: bool) -> None:
        """``P' ← keep·P' + c·XᵀX`` for the group, the Gram accumulated into ``P'`` by the
        GEMM itself (16-bit ``rows`` on the tensor cores where torch has the batched kernel,
        else their wide copy ``x``, made here when None)."""
        acc = self.acc
        k = _one_or_vector(keep, acc)
        beta = 1.0
        if isinstance(k, float) and k == 0.0:
            beta = 0.0  # baddbmm ignores what P' held
        elif not (isinstance(k, float) and k == 1.0):
            acc.mul_(k)
        c = _one_or_vector(coef, acc)
        sixteen = rows.is_cuda and rows.element_size() == 2
        if isinstance(c, float) and sixteen and fused_16bit and acc.dtype == torch.float32:
            torch.baddbmm(acc, rows.mT, rows, beta=beta, alpha=c, out_dtype=torch.float32,
                          out=acc)
            return
        x = (rows if x is None else x).to(acc.dtype)
        if not isinstance(c, float):
            x = x * c.sqrt()  # each member's rows scaled by √c_i: P' += (√c X)ᵀ(√c X)
            c = 1.0
        acc.baddbmm_(x.mT, x, beta=beta, alpha=c)

    def _count(self, rows: Tensor, traffic: Traffic, deferred: bool) -> None:
        g, m, d = rows.shape
        traffic.group_folds += 1
        traffic.device_folds += g
        traffic.fold_flops += g * accumulate_flops("rows", d, False, m)
        traffic.fold_device_bytes += g * accumulate_bytes(
            "rows", d, False, m, in_bytes=rows.element_size(),
            acc_bytes=self.acc.element_size(), fused=True, deferred=deferred)

    def traces(self) -> Tensor:
        """``[G]`` traces of the pending sums ``P'`` with the held updates (float64): what
        ``P'`` will be once they are folded (``base·P'``: an emptied ``P'`` still holds stale
        entries until then)."""
        tr = self.acc.diagonal(dim1=1, dim2=2).sum(-1, dtype=torch.float64)
        if not self.held:
            return tr
        base = _one_or_vector(self.base, self.held_trace)
        return tr.mul_(base).add_(self.held_trace)


class GroupRegistry:
    """A store's groups (`FactorStore.push_group`), by their keys and by member.

    Args:
        compute_dtype: The pending sums' dtype.
        traffic: Where the folds are counted.
        defer: Updates a group holds before one fold (`DeviceGroup.defer`).
    """

    def __init__(self, compute_dtype: torch.dtype, traffic: Traffic, defer: int = 1) -> None:
        self.compute_dtype = compute_dtype
        self.traffic = traffic
        self.defer = max(1, int(defer))
        self.groups: dict[tuple[str, ...], DeviceGroup] = {}
        self._by_key: dict[str, DeviceGroup] = {}

    def group_of(self, keys: tuple[str, ...], d: int, device: torch.device) -> DeviceGroup:
        """The group of ``keys``, made at its first update (a member of another group leaves
        it: that group is folded and dropped, its members keep their slices until grouped
        again)."""
        group = self.groups.get(keys)
        if group is None:
            for other in [k for k in self.groups if not set(k).isdisjoint(keys)]:
                self.drop(other)
            z = torch.stack([probes(k, d) for k in keys])  # [G, d, p]
            group = self.groups[keys] = DeviceGroup(keys, d, self.compute_dtype, device, z)
            group.defer = self.defer
            self._by_key.update(dict.fromkeys(keys, group))
        return group

    def accumulate(self, group: DeviceGroup, members: list[StoredFactor], rows: Tensor, *,
                   n: float, positions: int, lam: float, spare: int) -> None:
        """`DeviceGroup.accumulate`, then a fold of its held rows if every group's together
        would pass ``spare`` bytes (the device budget's room)."""
        fused = rows.is_cuda and batched_16bit(rows.device)
        group.accumulate(members, rows, n, positions, lam=lam, traffic=self.traffic,
                         fused_16bit=fused)
        if sum(g.held_bytes for g in self.groups.values()) > spare:
            group.fold_held(fused, self.traffic)  # held rows stay inside the device budget

    def fold_held(self, key: str | None = None) -> None:
        """Fold the held rows of ``key``'s group (None: every group's)."""
        groups = self.groups.values() if key is None else \
            [g for g in [self._by_key.get(key)] if g is not None]
        for group in groups:
            if group.held:
                group.fold_held(group.acc.is_cuda and batched_16bit(group.acc.device),
                                self.traffic)

    def drop(self, keys: tuple[str, ...]) -> None:
        """Fold the group of ``keys``'s held rows and forget the group."""
        group = self.groups.pop(keys, None)
        if group is not None:
            group.fold_held(group.acc.is_cuda and batched_16bit(group.acc.device), self.traffic)
            for k in keys:
                self._by_key.pop(k, None)

    def drop_held(self) -> None:
        """Forget every group's held rows (a load drops what is pending)."""
        for group in self.groups.values():
            group.drop_held()

    def clear(self) -> None:
        self.groups.clear()
        self._by_key.clear()

    def live_traces(self, factors: dict[str, StoredFactor]
                    ) -> tuple[list[StoredFactor], list[Tensor]]:
        """The members of every group still linked to it and their traces (``[G]`` per
        group, `DeviceGroup.traces`)."""
        live, parts = [], []
        for keys, group in self.groups.items():
            members = [factors[k] for k in keys]
            if all(f.device is not None and f.device.data is v
                   for f, v in zip(members, group.acc_views)):
                live += members
                parts.append(group.traces())
        return live, parts
